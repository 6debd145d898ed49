package fs

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

func lstat(t *testing.T, p string) unix.Stat_t {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st
}

// TestCopyUpKinds changes the metadata of every kind of lower entry and
// checks that copy-up kept everything else: content, mode, owner, mtime
// and st_ino, also after a remount.
func TestCopyUpKinds(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	type want struct {
		st      unix.Stat_t
		content string
	}
	paths := []string{"a/one.txt", "link", "fifo", "empty", "secret.txt", "big.bin"}
	before := map[string]want{}
	for _, p := range paths {
		w := want{st: lstat(t, e.path(p))}
		if w.st.Mode&syscall.S_IFMT == syscall.S_IFREG {
			w.content = e.read(p)
		}
		before[p] = w
	}
	if before["a/one.txt"].st.Uid != 1234 || before["a/one.txt"].st.Gid != 5678 {
		t.Fatalf("lower owner not reported: %d:%d", before["a/one.txt"].st.Uid, before["a/one.txt"].st.Gid)
	}

	newTime := time.Date(2025, 1, 2, 3, 4, 5, 6, time.UTC)
	ts := []unix.Timespec{unix.NsecToTimespec(newTime.UnixNano()), unix.NsecToTimespec(newTime.UnixNano())}
	// A change of each kind of metadata copies up.
	if err := os.Chmod(e.path("a/one.txt"), 0o640); err != nil {
		t.Fatal(err)
	}
	if err := unix.Lchown(e.path("link"), 42, 43); err != nil {
		t.Fatal(err)
	}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, e.path("fifo"), ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(e.path("empty"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(e.path("secret.txt"), 7, 8); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(e.path("big.bin"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("X"), 100); err != nil {
		t.Fatal(err)
	}
	f.Close()

	check := func(stage string) {
		for _, p := range paths {
			b := before[p]
			got := lstat(t, e.path(p))
			if got.Ino != b.st.Ino {
				t.Errorf("%s %s: ino %d, want %d", stage, p, got.Ino, b.st.Ino)
			}
			wantMode, wantUid, wantGid, wantMtime := b.st.Mode, b.st.Uid, b.st.Gid, b.st.Mtim
			switch p {
			case "a/one.txt":
				wantMode = syscall.S_IFREG | 0o640
			case "link":
				wantUid, wantGid = 42, 43
			case "fifo":
				wantMtime = ts[1]
			case "empty":
				wantMode = syscall.S_IFDIR | 0o700
			case "secret.txt":
				wantUid, wantGid = 7, 8
			}
			if got.Mode != wantMode || got.Uid != wantUid || got.Gid != wantGid {
				t.Errorf("%s %s: mode %o owner %d:%d, want %o %d:%d", stage, p, got.Mode, got.Uid, got.Gid, wantMode, wantUid, wantGid)
			}
			if p != "big.bin" && got.Mtim != wantMtime {
				t.Errorf("%s %s: mtime %v, want %v", stage, p, got.Mtim, wantMtime)
			}
			if b.content != "" {
				c := e.read(p)
				if p == "big.bin" {
					want := []byte(b.content)
					want[100] = 'X'
					if c != string(want) {
						t.Errorf("%s big.bin: content differs", stage)
					}
				} else if c != b.content {
					t.Errorf("%s %s: content %q, want %q", stage, p, c, b.content)
				}
			}
		}
		if tgt, err := os.Readlink(e.path("link")); err != nil || tgt != "top.txt" {
			t.Errorf("%s link -> %q, %v", stage, tgt, err)
		}
	}
	check("after copy-up")
	for _, p := range paths {
		if _, err := os.Lstat(filepath.Join(e.upper, p)); err != nil {
			t.Errorf("%s not in the upper layer: %v", p, err)
		}
	}
	e.remount()
	check("after remount")
}

// TestWhiteouts deletes lower files, a lower tree and a lower file with a
// name too long for a prefixed marker; nothing comes back after a remount.
func TestWhiteouts(t *testing.T) {
	long := strings.Repeat("n", 250)
	lower, _ := packLower(t, func(dir string) {
		sampleTree(dir)
		os.WriteFile(filepath.Join(dir, long), []byte("long"), 0o644)
	})
	e := mountEnv(t, lower, Options{})
	for _, p := range []string{"top.txt", long, "link", "fifo"} {
		if err := os.Remove(e.path(p)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.RemoveAll(e.path("skills")); err != nil {
		t.Fatal(err)
	}
	// Deleting a copied-up file leaves no lower version behind.
	e.write("a/one.txt", "changed")
	if err := os.Remove(e.path("a/one.txt")); err != nil {
		t.Fatal(err)
	}
	check := func() {
		for _, p := range []string{"top.txt", long, "link", "fifo", "skills", "a/one.txt"} {
			e.missing(p)
		}
		got := e.names("")
		want := []string{"a", "big.bin", "empty", "secret.txt", "t"}
		if !slices.Equal(got, want) {
			t.Errorf("root lists %v, want %v", got, want)
		}
		if got := e.names("a"); !slices.Equal(got, []string{"b", "one-hard.txt"}) {
			t.Errorf("a lists %v", got)
		}
	}
	check()
	e.remount()
	check()
	// A name can be used again.
	e.write("top.txt", "new top")
	e.remount()
	if got := e.read("top.txt"); got != "new top" {
		t.Errorf("recreated top.txt = %q", got)
	}
}

// TestOpaqueDir removes a lower directory and makes one of the same name:
// the new one starts empty, and stays so after a remount.
func TestOpaqueDir(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	oldIno := e.ino("skills")
	if err := os.RemoveAll(e.path("skills")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(e.path("skills"), 0o755); err != nil {
		t.Fatal(err)
	}
	if got := e.names("skills"); len(got) != 0 {
		t.Fatalf("recreated dir lists %v", got)
	}
	if e.ino("skills") == oldIno {
		t.Errorf("recreated directory kept the old st_ino")
	}
	e.write("skills/mine.txt", "x")
	e.remount()
	if got := e.names("skills"); !slices.Equal(got, []string{"mine.txt"}) {
		t.Fatalf("after remount: %v", got)
	}
	// Removing the opaque directory again works (it holds a marker).
	if err := os.RemoveAll(e.path("skills")); err != nil {
		t.Fatal(err)
	}
	e.missing("skills")
}

// TestMergedReaddir checks listings: both layers, no duplicates, no
// overlay names, d_ino equal to st_ino.
func TestMergedReaddir(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	e.write("a/one.txt", "copied up")
	e.write("a/new.txt", "new")
	if err := os.Remove(e.path("a/b/two.txt")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(e.path("a/newdir"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{"", "a", "a/b", "skills"} {
		f, err := os.Open(e.path(dir))
		if err != nil {
			t.Fatal(err)
		}
		var buf [8192]byte
		seen := map[string]bool{}
		for {
			n, err := unix.Getdents(int(f.Fd()), buf[:])
			if err != nil {
				t.Fatal(err)
			}
			if n == 0 {
				break
			}
			for b := buf[:n]; len(b) > 0; {
				ino := *(*uint64)(unsafePointer(&b[0]))
				reclen := int(b[16]) | int(b[17])<<8
				name := string(bytes.TrimRight(b[19:reclen], "\x00"))
				b = b[reclen:]
				if seen[name] {
					t.Errorf("%s: %q listed twice", dir, name)
				}
				seen[name] = true
				if name == "." || name == ".." {
					continue
				}
				if isReserved(name) {
					t.Errorf("%s: overlay name %q listed", dir, name)
				}
				if st := lstat(t, filepath.Join(e.path(dir), name)); st.Ino != ino {
					t.Errorf("%s/%s: d_ino %d, st_ino %d", dir, name, ino, st.Ino)
				}
			}
		}
		f.Close()
	}
	if got := e.names("a"); !slices.Equal(got, []string{"b", "new.txt", "newdir", "one-hard.txt", "one.txt"}) {
		t.Errorf("a lists %v", got)
	}
	if got := e.names("a/b"); len(got) != 0 {
		t.Errorf("a/b lists %v", got)
	}
}

// TestRenameLower renames lower files and whole lower directories.
func TestRenameLower(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	dirIno, deepIno := e.ino("skills/web"), e.ino("skills/web/sub/deep.txt")
	topIno := e.ino("top.txt")

	if err := os.Rename(e.path("top.txt"), e.path("a/top-moved.txt")); err != nil {
		t.Fatal(err)
	}
	// A lower directory, with a change inside it first.
	e.write("skills/web/sub/added.txt", "added")
	if err := os.Remove(e.path("skills/web/SKILL.md")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(e.path("skills/web"), e.path("skills/browser")); err != nil {
		t.Fatal(err)
	}
	// A lower directory over an empty lower directory.
	if err := os.Rename(e.path("a/b/two.txt"), e.path("two.txt")); err != nil {
		t.Fatal(err)
	}
	// (os.Rename refuses to replace a directory; rename(2) does not.)
	if err := unix.Rename(e.path("a/b"), e.path("empty")); err != nil {
		t.Fatal(err)
	}
	// A lower file over another lower file.
	if err := os.Rename(e.path("secret.txt"), e.path("big.bin")); err != nil {
		t.Fatal(err)
	}

	check := func(stage string) {
		e.missing("top.txt")
		e.missing("skills/web")
		e.missing("a/b")
		e.missing("secret.txt")
		if got := e.read("a/top-moved.txt"); got != "top" {
			t.Errorf("%s: moved file = %q", stage, got)
		}
		if got := e.ino("a/top-moved.txt"); got != topIno {
			t.Errorf("%s: moved file ino %d, want %d", stage, got, topIno)
		}
		if got := e.names("skills/browser"); !slices.Equal(got, []string{"sub"}) {
			t.Errorf("%s: moved dir lists %v", stage, got)
		}
		if got := e.names("skills/browser/sub"); !slices.Equal(got, []string{"added.txt", "deep.txt"}) {
			t.Errorf("%s: moved subdir lists %v", stage, got)
		}
		if got := e.read("skills/browser/sub/deep.txt"); got != "deep" {
			t.Errorf("%s: deep = %q", stage, got)
		}
		if e.ino("skills/browser") != dirIno || e.ino("skills/browser/sub/deep.txt") != deepIno {
			t.Errorf("%s: moved tree changed st_ino", stage)
		}
		if got := e.names("empty"); len(got) != 0 {
			t.Errorf("%s: empty (was a/b) lists %v", stage, got)
		}
		if got := e.read("big.bin"); got != "s3cret" {
			t.Errorf("%s: big.bin = %q", stage, got)
		}
	}
	check("live")
	e.remount()
	check("remounted")

	// Moving it back shows the same tree at the old place.
	if err := os.Rename(e.path("skills/browser"), e.path("skills/web")); err != nil {
		t.Fatal(err)
	}
	if got := e.names("skills/web/sub"); !slices.Equal(got, []string{"added.txt", "deep.txt"}) {
		t.Errorf("moved back: %v", got)
	}
	if got := e.names("skills/web"); !slices.Equal(got, []string{"sub"}) {
		t.Errorf("moved back: %v", got)
	}
	// Into a new directory, then a rename over a non-empty directory fails.
	if err := os.MkdirAll(e.path("x/y"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(e.path("skills/web"), e.path("x/y/web")); err != nil {
		t.Fatal(err)
	}
	if got := e.read("x/y/web/sub/deep.txt"); got != "deep" {
		t.Errorf("deep = %q", got)
	}
	if err := unix.Rename(e.path("x"), e.path("a")); !errors.Is(err, syscall.ENOTEMPTY) {
		t.Errorf("rename over a non-empty lower dir: %v", err)
	}
	if err := unix.Rename(e.path("x"), e.path("a/one.txt")); !errors.Is(err, syscall.ENOTDIR) {
		t.Errorf("rename dir over file: %v", err)
	}
	if err := unix.Rename(e.path("a/one.txt"), e.path("x")); !errors.Is(err, syscall.EISDIR) {
		t.Errorf("rename file over dir: %v", err)
	}
}

// TestRenameExchange swaps a lower and an upper entry atomically.
func TestRenameExchange(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	e.write("mine.txt", "mine")
	if err := unix.Renameat2(unix.AT_FDCWD, e.path("mine.txt"), unix.AT_FDCWD, e.path("top.txt"), unix.RENAME_EXCHANGE); err != nil {
		t.Fatal(err)
	}
	if e.read("mine.txt") != "top" || e.read("top.txt") != "mine" {
		t.Fatalf("exchange: mine=%q top=%q", e.read("mine.txt"), e.read("top.txt"))
	}
	if err := unix.Renameat2(unix.AT_FDCWD, e.path("a"), unix.AT_FDCWD, e.path("skills"), unix.RENAME_EXCHANGE); err != nil {
		t.Fatal(err)
	}
	e.remount()
	if got := e.names("skills"); !slices.Equal(got, []string{"b", "one-hard.txt", "one.txt"}) {
		t.Errorf("skills (was a) lists %v", got)
	}
	if got := e.names("a"); !slices.Equal(got, []string{"web"}) {
		t.Errorf("a (was skills) lists %v", got)
	}
	if err := unix.Renameat2(unix.AT_FDCWD, e.path("mine.txt"), unix.AT_FDCWD, e.path("top.txt"), unix.RENAME_NOREPLACE); !errors.Is(err, syscall.EEXIST) {
		t.Errorf("RENAME_NOREPLACE over an existing name: %v", err)
	}
}

// TestHardLinks covers links across layers: a lower pair stays one inode
// through copy-up, and a new link to a lower file shares its inode.
func TestHardLinks(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	one, hard := lstat(t, e.path("a/one.txt")), lstat(t, e.path("a/one-hard.txt"))
	if one.Ino != hard.Ino || one.Nlink != 2 {
		t.Fatalf("lower hard links: ino %d/%d nlink %d", one.Ino, hard.Ino, one.Nlink)
	}
	e.write("a/one-hard.txt", "through the other name")
	if got := e.read("a/one.txt"); got != "through the other name" {
		t.Errorf("other name reads %q", got)
	}
	if st := lstat(t, e.path("a/one.txt")); st.Ino != one.Ino || st.Nlink != 2 {
		t.Errorf("after copy-up: ino %d nlink %d, want %d 2", st.Ino, st.Nlink, one.Ino)
	}

	top := lstat(t, e.path("top.txt"))
	if err := os.Link(e.path("top.txt"), e.path("a/top-link")); err != nil {
		t.Fatal(err)
	}
	l := lstat(t, e.path("a/top-link"))
	if l.Ino != top.Ino || l.Nlink != 2 {
		t.Errorf("new link: ino %d nlink %d, want %d 2", l.Ino, l.Nlink, top.Ino)
	}
	e.write("a/top-link", "via link")
	e.remount()
	if e.read("top.txt") != "via link" || e.ino("top.txt") != top.Ino || e.ino("a/top-link") != top.Ino {
		t.Errorf("after remount: %q ino %d/%d want %d", e.read("top.txt"), e.ino("top.txt"), e.ino("a/top-link"), top.Ino)
	}
	if e.ino("a/one.txt") != one.Ino || e.ino("a/one-hard.txt") != one.Ino {
		t.Errorf("lower pair after remount: %d %d want %d", e.ino("a/one.txt"), e.ino("a/one-hard.txt"), one.Ino)
	}
}

// TestInodeStability: st_ino never changes for an object, in either layer,
// through copy-up, rename and remount, and upper-born objects never take a
// lower object's number.
func TestInodeStability(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	lowerInos := map[uint64]string{}
	filepath.Walk(e.mnt, func(p string, info os.FileInfo, err error) error {
		if err == nil {
			lowerInos[info.Sys().(*syscall.Stat_t).Ino] = p
		}
		return nil
	})
	want := map[string]uint64{}
	for _, p := range []string{"a", "a/b", "a/b/two.txt", "big.bin", "skills/web/SKILL.md"} {
		want[p] = e.ino(p)
	}
	e.write("new.txt", "n")
	os.Mkdir(e.path("newdir"), 0o755)
	for _, p := range []string{"new.txt", "newdir"} {
		ino := e.ino(p)
		if q, ok := lowerInos[ino]; ok {
			t.Errorf("%s got st_ino %d of lower %s", p, ino, q)
		}
		want[p] = ino
	}
	e.write("a/b/two.txt", "copy")
	os.Chmod(e.path("a"), 0o700)
	f, _ := os.OpenFile(e.path("big.bin"), os.O_RDWR, 0)
	f.Truncate(10)
	f.Close()
	e.write("new.txt", "rewritten in place")
	check := func(stage string) {
		for p, ino := range want {
			if got := e.ino(p); got != ino {
				t.Errorf("%s: %s st_ino %d, want %d", stage, p, got, ino)
			}
		}
	}
	check("after changes")
	e.remount()
	check("after remount")
}

// TestRootAttrs: a new upper layer gives the mount root the archived
// root's mode and owner.
func TestRootAttrs(t *testing.T) {
	lower, _ := packLower(t, func(dir string) {
		os.Chmod(dir, 0o750)
		os.Chown(dir, 1000, 1001)
	})
	e := mountEnv(t, lower, Options{})
	st := lstat(t, e.mnt)
	if st.Mode&0o7777 != 0o750 || st.Uid != 1000 || st.Gid != 1001 {
		t.Errorf("mount root: mode %o owner %d:%d, want 750 1000:1001", st.Mode&0o7777, st.Uid, st.Gid)
	}
}

func TestReservedNames(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	for _, name := range []string{".wh.x", ".wh..wh..opq"} {
		if err := os.WriteFile(e.path(name), nil, 0o644); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("create %s: %v, want EINVAL", name, err)
		}
		if err := os.Mkdir(e.path(name), 0o755); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("mkdir %s: %v, want EINVAL", name, err)
		}
	}
	e.write("ok", "")
	if err := os.Rename(e.path("ok"), e.path(".wh.ok")); !errors.Is(err, syscall.EINVAL) {
		t.Errorf("rename to .wh.: %v", err)
	}
	// The overlay's own files never show.
	if got := e.names(""); !slices.Equal(got, []string{"ok"}) {
		t.Errorf("root lists %v", got)
	}
}

func TestStatfs(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	var s unix.Statfs_t
	if err := unix.Statfs(e.mnt, &s); err != nil {
		t.Fatal(err)
	}
	if s.Namelen != 255 {
		t.Errorf("NAME_MAX %d, want 255", s.Namelen)
	}
	if s.Blocks == 0 || s.Bsize == 0 {
		t.Errorf("no capacity reported: %+v", s)
	}
	long := strings.Repeat("x", 255)
	e.write(long, "ok")
	if err := os.WriteFile(e.path(long+"y"), nil, 0o644); !errors.Is(err, syscall.ENAMETOOLONG) {
		t.Errorf("256-byte name: %v", err)
	}
}

// TestDeepTree goes past PATH_MAX below the mount.
func TestDeepTree(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	seg := strings.Repeat("d", 200)
	dir, err := os.Open(e.mnt)
	if err != nil {
		t.Fatal(err)
	}
	depth := 0
	for ; depth < 30; depth++ { // 30 * 201 bytes > 4096
		if err := unix.Mkdirat(int(dir.Fd()), seg, 0o755); err != nil {
			t.Fatalf("depth %d: %v", depth, err)
		}
		fd, err := unix.Openat(int(dir.Fd()), seg, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			t.Fatalf("depth %d: %v", depth, err)
		}
		dir.Close()
		dir = os.NewFile(uintptr(fd), seg)
	}
	defer dir.Close()
	fd, err := unix.Openat(int(dir.Fd()), "leaf", unix.O_CREAT|unix.O_WRONLY, 0o644)
	if err != nil {
		t.Fatalf("create at depth %d: %v", depth, err)
	}
	unix.Write(fd, []byte("deep"))
	unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstatat(int(dir.Fd()), "leaf", &st, 0); err != nil || st.Size != 4 {
		t.Fatalf("stat leaf: %v size %d", err, st.Size)
	}
	if err := unix.Renameat(int(dir.Fd()), "leaf", int(dir.Fd()), "leaf2"); err != nil {
		t.Fatal(err)
	}
}

// TestUnmountWithOpenFiles: the mount leaves the namespace at once and the
// server ends when the last file closes.
func TestUnmountWithOpenFiles(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	e.write("f", "x")
	f, err := os.Open(e.path("f"))
	if err != nil {
		t.Fatal(err)
	}
	m := e.m
	e.m = nil
	done := make(chan error, 1)
	go func() { done <- m.Unmount(context.Background()) }()
	deadline := time.Now().Add(5 * time.Second)
	for !isNotMounted(e.mnt) {
		if time.Now().After(deadline) {
			t.Fatal("still mounted after lazy unmount")
		}
		time.Sleep(10 * time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("unmount returned with a file open: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	buf := make([]byte, 1)
	if _, err := f.Read(buf); err != nil || buf[0] != 'x' {
		t.Errorf("open file after detach: %q %v", buf, err)
	}
	f.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("unmount did not finish after the last close")
	}
	m.Wait()
}

// TestCorruptLower turns a damaged lower block into EIO, never wrong bytes.
func TestCorruptLower(t *testing.T) {
	needFuse(t)
	src := tempDir(t)
	content := bytes.Repeat([]byte("hermes memory "), 100000)
	if err := os.WriteFile(filepath.Join(src, "data"), content, 0o644); err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(tempDir(t), "img.sqfs")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := archive.PackDir(t.Context(), f, src, archive.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	raw, err := os.ReadFile(img)
	if err != nil {
		t.Fatal(err)
	}
	raw[200] ^= 0xff // inside the first data block (after the 96-byte superblock)
	if err := os.WriteFile(img, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	lower := openLower(t, img)
	e := mountEnv(t, lower, Options{})
	_, err = os.ReadFile(e.path("data"))
	if !errors.Is(err, syscall.EIO) {
		t.Fatalf("read of a corrupt block: %v, want EIO", err)
	}
	// A truncating write needs none of the old content: it copies up.
	e.write("data", "x")
	if got := e.read("data"); got != "x" {
		t.Errorf("after a truncating write: %q", got)
	}
}

// TestCopyUpContent copies up a lower file of several copy-up chunks, with a
// hole and a short last chunk, at its first write; and refuses (EIO, the
// file left as it was, nothing left in the work directory) one whose
// content is damaged in a later chunk.
func TestCopyUpContent(t *testing.T) {
	needFuse(t)
	src := tempDir(t)
	const size = 5*copyUpBuf + 12345
	good := randBytes(size, 7)
	clear(good[2*copyUpBuf : 3*copyUpBuf]) // a whole chunk of zeros: a hole
	bad := randBytes(size, 8)
	must(t, os.WriteFile(filepath.Join(src, "good"), good, 0o644))
	must(t, os.WriteFile(filepath.Join(src, "bad"), bad, 0o644))
	img := filepath.Join(tempDir(t), "img.sqfs")
	f, err := os.Create(img)
	must(t, err)
	if _, err := archive.PackDir(t.Context(), f, src, archive.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	// Random bytes are stored as they are: damage bad's fourth chunk.
	raw, err := os.ReadFile(img)
	must(t, err)
	damage := 3*copyUpBuf + 777
	at := bytes.Index(raw, bad[damage:damage+64])
	if at < 0 {
		t.Fatal("bad's block not found in the image")
	}
	raw[at] ^= 0xff
	must(t, os.WriteFile(img, raw, 0o644))
	// Whole-file copy-up (partial_test.go covers copy-up by range).
	e := mountEnv(t, openLower(t, img), Options{CopyUpByRangeMin: -1})

	fd, err := unix.Open(e.path("good"), unix.O_WRONLY, 0)
	must(t, err)
	_, err = unix.Pwrite(fd, []byte("!"), copyUpBuf+5)
	unix.Close(fd)
	must(t, err)
	good[copyUpBuf+5] = '!'
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(e.upper, "good"), &st))
	if st.Size != size {
		t.Errorf("upper copy has %d bytes, want %d", st.Size, size)
	}
	if st.Blocks*512 > size-copyUpBuf/2 {
		t.Errorf("upper copy uses %d bytes of disk for %d with a %d-byte hole", st.Blocks*512, size, copyUpBuf)
	}
	if got, err := os.ReadFile(e.path("good")); err != nil || !bytes.Equal(got, good) {
		t.Errorf("good after copy-up: %d bytes, %v; want its lower content with one byte written", len(got), err)
	}

	if fd, err := unix.Open(e.path("bad"), unix.O_WRONLY|unix.O_APPEND, 0); !errors.Is(err, syscall.EIO) {
		if err == nil {
			unix.Close(fd)
		}
		t.Fatalf("open for append of a file with a damaged block: %v, want EIO", err)
	}
	if _, err := os.Lstat(filepath.Join(e.upper, "bad")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed copy-up left bad in the upper layer (%v)", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.upper, workDirName)); len(ents) != 0 {
		t.Errorf("a failed copy-up left %d entries in the work directory", len(ents))
	}
	fr, err := os.Open(e.path("bad"))
	must(t, err)
	defer fr.Close()
	head := make([]byte, copyUpBuf)
	if _, err := fr.ReadAt(head, 0); err != nil || !bytes.Equal(head, bad[:copyUpBuf]) {
		t.Errorf("bad's undamaged first chunk after the failed copy-up: %v", err)
	}
	if _, err := fr.ReadAt(head, int64(damage)); !errors.Is(err, syscall.EIO) {
		t.Errorf("read of bad's damaged chunk: %v, want EIO", err)
	}
}
