package fs

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// TestReaddirNoOpendir: directories are listed without OPENDIR and
// RELEASEDIR requests (one OPENDIR, answered ENOSYS, turns them off for
// the connection), merged listings are right, and a listing read again
// comes from the kernel's cache.
func TestReaddirNoOpendir(t *testing.T) {
	t.Parallel()
	lower, _ := packLower(t, sampleTree)
	st := NewStats()
	e := mountEnv(t, lower, Options{Stats: st})
	e.write("a/new.txt", "n")
	must(t, os.Remove(e.path("a/one.txt")))
	want := []string{"b", "new.txt", "one-hard.txt"}
	for i := range 3 {
		if got := e.names("a"); !slices.Equal(got, want) {
			t.Fatalf("listing %d of a: %v, want %v", i, got, want)
		}
	}
	for _, d := range []string{"", "skills", "skills/web", "skills/web/sub", "empty"} {
		if _, err := os.ReadDir(e.path(d)); err != nil {
			t.Fatal(err)
		}
	}
	ops := opCalls(st)
	if ops["opendir"] > 1 || ops["releasedir"] != 0 {
		t.Errorf("%d OPENDIR and %d RELEASEDIR requests, want at most one and none", ops["opendir"], ops["releasedir"])
	}
	rd := ops["readdirplus"] + ops["readdir"]
	if rd == 0 {
		t.Fatal("no READDIR requests at all")
	}
	for range 3 {
		e.names("skills/web")
	}
	if got := opCalls(st); got["readdirplus"]+got["readdir"] != rd {
		t.Errorf("listing a listed directory again made %d READDIR requests", got["readdirplus"]+got["readdir"]-rd)
	}
	// The name the overlay uses to find a directory's node is an
	// ordinary missing name to users.
	if _, err := os.Lstat(e.path("a/" + probeName)); !os.IsNotExist(err) {
		t.Errorf("lstat of %s: %v, want ENOENT", probeName, err)
	}
}

// readSome reads directory entries from fd with a small buffer, up to max
// names (all with max < 0), skipping "." and "..".
func readSome(t *testing.T, fd int, max int) []string {
	t.Helper()
	var names []string
	buf := make([]byte, 512)
	for max < 0 || len(names) < max {
		k, err := unix.Getdents(fd, buf)
		must(t, err)
		if k == 0 {
			break
		}
		for off := 0; off < k; {
			var de fuse.DirEntry
			off += de.Parse(buf[off:k])
			if de.Name != "." && de.Name != ".." {
				names = append(names, de.Name)
			}
		}
	}
	return names
}

// TestReaddirStableWhileChanging: a reader going through a directory in
// many requests while the directory changes (shutil.rmtree unlinks as it
// reads) sees every entry that was there when it started exactly once, as
// does a second reader interleaved with it.
func TestReaddirStableWhileChanging(t *testing.T) {
	t.Parallel()
	const n = 300
	lower, _ := packLower(t, func(dir string) {
		os.MkdirAll(filepath.Join(dir, "d"), 0o755)
		for i := range n / 2 {
			os.WriteFile(filepath.Join(dir, "d", fmt.Sprintf("lower-entry-with-a-long-name-%03d", i)), nil, 0o644)
		}
	})
	e := mountEnv(t, lower, Options{})
	var orig []string
	for i := range n / 2 {
		e.write(fmt.Sprintf("d/upper-entry-with-a-long-name-%03d", i), "")
		orig = append(orig, fmt.Sprintf("lower-entry-with-a-long-name-%03d", i), fmt.Sprintf("upper-entry-with-a-long-name-%03d", i))
	}
	// Not listed before the readers start: the kernel has no complete
	// listing cached, so their reads reach the overlay.
	open := func() int {
		fd, err := unix.Open(e.path("d"), unix.O_RDONLY|unix.O_DIRECTORY, 0)
		must(t, err)
		t.Cleanup(func() { unix.Close(fd) })
		return fd
	}
	a, b := open(), open()
	seenA := readSome(t, a, 20)
	seenB := readSome(t, b, 50)
	for i, name := range seenA {
		// Remove what was read, add new names.
		must(t, os.Remove(e.path("d/"+name)))
		e.write(fmt.Sprintf("d/zz-added-%03d", i), "")
		if i%5 == 0 {
			seenB = append(seenB, readSome(t, b, 7)...)
		}
	}
	seenA = append(seenA, readSome(t, a, -1)...)
	seenB = append(seenB, readSome(t, b, -1)...)
	for _, seen := range [][]string{seenA, seenB} {
		count := map[string]int{}
		for _, name := range seen {
			count[name]++
		}
		for _, name := range orig {
			if count[name] != 1 {
				t.Errorf("%s seen %d times by a reader that began before the changes", name, count[name])
			}
		}
		for name, c := range count {
			if c > 1 {
				t.Errorf("%s seen %d times", name, c)
			}
			if !slices.Contains(orig, name) && !strings.HasPrefix(name, "zz-added-") {
				t.Errorf("%s never existed", name)
			}
		}
	}
	// A new listing shows the directory as it is now.
	if got := e.names("d"); len(got) != n {
		t.Errorf("after the changes: %d entries, want %d", len(got), n)
	}
}

// TestReaddirOpenDirRemoved: fstat of a directory open while it is removed,
// or replaced by a rename, answers from the directory (no handle keeps it:
// the node does).
func TestReaddirOpenDirRemoved(t *testing.T) {
	t.Parallel()
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	for _, how := range []string{"rmdir", "rename"} {
		dir := e.path("gone-" + how)
		must(t, os.Mkdir(dir, 0o710))
		var before unix.Stat_t
		must(t, unix.Stat(dir, &before))
		fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		must(t, err)
		if how == "rmdir" {
			must(t, unix.Rmdir(dir))
		} else {
			must(t, os.Mkdir(dir+"-src", 0o755))
			must(t, unix.Rename(dir+"-src", dir))
		}
		var st unix.Stat_t
		err = unix.Fstat(fd, &st)
		unix.Close(fd)
		if err != nil || st.Mode != before.Mode || st.Ino != before.Ino {
			t.Errorf("%s: fstat of the open directory: mode %o ino %d, %v; want mode %o ino %d", how, st.Mode, st.Ino, err, before.Mode, before.Ino)
		}
	}
	// And of a merged one (a lower directory with an upper side).
	must(t, os.Remove(e.path("a/b/two.txt")))
	fd, err := unix.Open(e.path("a/b"), unix.O_RDONLY|unix.O_DIRECTORY, 0)
	must(t, err)
	defer unix.Close(fd)
	must(t, unix.Rmdir(e.path("a/b")))
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		t.Errorf("fstat of a removed merged directory: mode %o, %v", st.Mode, err)
	}
}

// TestReaddirAfterChanges: a directory listed (and its listing cached by
// the kernel, without OPENDIR) lists its changes at once, whether this
// process or another one made them: a create, a mkdir, a symlink, a rename
// within it, in and out of it, an unlink and an rmdir, in a lower, a merged
// and an upper-only directory.
func TestReaddirAfterChanges(t *testing.T) {
	t.Parallel()
	sh := needTool(t, "sh")
	lower, _ := packLower(t, sampleTree)
	st := NewStats()
	e := mountEnv(t, lower, Options{Stats: st})
	must(t, os.Mkdir(e.path("up"), 0o755))
	e.write("up/u1", "u")
	e.write("a/b/merged", "m")
	dirs := map[string][]string{
		"skills/web": {"SKILL.md", "sub"},
		"a/b":        {"merged", "two.txt"},
		"up":         {"u1"},
	}
	list := func(d string) []string {
		t.Helper()
		got := e.names(d)
		slices.Sort(got)
		return got
	}
	for d, want := range dirs {
		if got := list(d); !slices.Equal(got, want) {
			t.Fatalf("%s: %v, want %v", d, got, want)
		}
	}
	// Listed again: from the kernel's cache, no READDIR.
	rd := func() uint64 { o := opCalls(st); return o["readdir"] + o["readdirplus"] }
	r0 := rd()
	for d := range dirs {
		list(d)
	}
	if r := rd(); r != r0 {
		t.Fatalf("listing listed directories again made %d READDIR requests; the test needs cached listings", r-r0)
	}

	for i, by := range []string{"this process", "another process"} {
		change := func(cmd string) {
			t.Helper()
			if by == "this process" {
				return
			}
			c := exec.Command(sh, "-ec", cmd)
			c.Dir = e.mnt
			if out, err := c.CombinedOutput(); err != nil {
				t.Fatalf("%s: %v: %s", cmd, err, out)
			}
		}
		p := fmt.Sprintf("p%d-", i)
		for d, want := range dirs {
			if by == "this process" {
				e.write(d+"/"+p+"new", "n")
				must(t, os.Mkdir(e.path(d+"/"+p+"dir"), 0o755))
				must(t, os.Symlink("x", e.path(d+"/"+p+"sym")))
				must(t, os.Rename(e.path(d+"/"+p+"new"), e.path(d+"/"+p+"renamed")))
				e.write(p+"moved-in", "i")
				must(t, os.Rename(e.path(p+"moved-in"), e.path(d+"/"+p+"moved-in")))
			} else {
				change(fmt.Sprintf("echo n > %[1]s/%[2]snew; mkdir %[1]s/%[2]sdir; ln -s x %[1]s/%[2]ssym; mv %[1]s/%[2]snew %[1]s/%[2]srenamed; echo i > %[2]smoved-in; mv %[2]smoved-in %[1]s/", d, p))
			}
			want = append(want, p+"dir", p+"moved-in", p+"renamed", p+"sym")
			slices.Sort(want)
			if got := list(d); !slices.Equal(got, want) {
				t.Errorf("%s after creates and renames by %s: %v, want %v", d, by, got, want)
			}
			// Out again: an unlink, an rmdir, a rename out.
			if by == "this process" {
				must(t, os.Remove(e.path(d+"/"+p+"sym")))
				must(t, os.Remove(e.path(d+"/"+p+"dir")))
				must(t, os.Rename(e.path(d+"/"+p+"moved-in"), e.path(p+"moved-out")))
			} else {
				change(fmt.Sprintf("rm %[1]s/%[2]ssym; rmdir %[1]s/%[2]sdir; mv %[1]s/%[2]smoved-in %[2]smoved-out", d, p))
			}
			want = slices.DeleteFunc(want, func(s string) bool { return s == p+"sym" || s == p+"dir" || s == p+"moved-in" })
			if got := list(d); !slices.Equal(got, want) {
				t.Errorf("%s after removals by %s: %v, want %v", d, by, got, want)
			}
			dirs[d] = want
		}
	}
	if ops := opCalls(st); ops["opendir"] > 1 {
		t.Errorf("%d OPENDIR requests, want at most the first", ops["opendir"])
	}
}
