package fs

import (
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// statsOf records, for every path of a tree, the attributes a snapshot
// keeps (mode, owner, size, link count, mtime), for directories and
// special files too. lstat gives them for a path of the tree.
func statsOf(t *testing.T, walk func(fn func(p string)) error, lstat func(p string) (*syscall.Stat_t, error)) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := walk(func(p string) {
		st, err := lstat(p)
		if err != nil {
			t.Errorf("lstat %s: %v", p, err)
			return
		}
		out[p] = fmt.Sprintf("mode=%o uid=%d gid=%d size=%d nlink=%d mtime=%d.%09d",
			st.Mode, st.Uid, st.Gid, st.Size, st.Nlink, st.Mtim.Sec, st.Mtim.Nsec)
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func mountStats(t *testing.T, root string) map[string]string {
	return statsOf(t, func(fn func(string)) error {
		return filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			fn(rel)
			return nil
		})
	}, func(p string) (*syscall.Stat_t, error) {
		var st syscall.Stat_t
		return &st, syscall.Lstat(filepath.Join(root, p), &st)
	})
}

func viewStats(t *testing.T, v *View) map[string]string {
	return statsOf(t, func(fn func(string)) error {
		return iofs.WalkDir(v, ".", func(p string, d iofs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fn(p)
			return nil
		})
	}, func(p string) (*syscall.Stat_t, error) {
		fi, err := v.Lstat(p)
		if err != nil {
			return nil, err
		}
		return fi.Sys().(*syscall.Stat_t), nil
	})
}

// TestFreezeKeepsAttributes: a view takes no status during the freeze, so
// every change after it must keep the status it replaces first. Each kind
// of change is made to upper objects of every kind after a freeze; the
// view must still show every attribute (directories' mtimes and link
// counts included) as it was, and so must a second view frozen in the
// middle of the changes for its own instant.
func TestFreezeKeepsAttributes(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	old := time.Date(2020, 1, 2, 3, 4, 5, 6, time.UTC)
	os.MkdirAll(e.path("d/sub"), 0o755)
	os.MkdirAll(e.path("d2"), 0o700)
	os.MkdirAll(e.path("gone/inner"), 0o755)
	e.write("d/f", "file")
	e.write("d/g", "other")
	e.write("d/h", "hard")
	must(t, os.Link(e.path("d/h"), e.path("d2/h-link")))
	e.write("d/big", string(randBytes(100<<10, 3)))
	e.write("d/victim", "replaced")
	e.write("d2/x", "x")
	must(t, os.Symlink("f", e.path("d/sym")))
	must(t, unix.Mkfifo(e.path("d/fifo"), 0o640))
	os.MkdirAll(e.path("a/b"), 0o755) // a lower directory copied up by a change below it
	e.write("a/b/new", "n")
	for _, p := range []string{"d/f", "d/g", "d/h", "d/big", "d/victim", "d2/x", "d/fifo", "d/sub", "d", "d2", "gone/inner", "gone", "a/b", "a"} {
		must(t, os.Chtimes(e.path(p), old, old))
	}
	// The copy-up of a lower directory changes its parent's upper mtime
	// behind the kernel's attribute cache: start from fresh caches.
	e.remount()
	want := mountStats(t, e.mnt)
	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()

	// Half the changes, a second view, the other half.
	f, err := os.OpenFile(e.path("d/f"), os.O_RDWR|os.O_APPEND, 0)
	must(t, err)
	_, err = f.Write([]byte(" appended"))
	must(t, err)
	must(t, f.Close())
	must(t, os.Truncate(e.path("d/big"), 10))
	must(t, os.Chmod(e.path("d/g"), 0o600))
	must(t, os.Chown(e.path("d/g"), 4321, 8765))
	must(t, os.Link(e.path("d/h"), e.path("d/h2"))) // nlink of d/h and d2/h-link
	must(t, os.Mkdir(e.path("d/sub/new"), 0o755))   // nlink and mtime of d/sub
	must(t, os.WriteFile(e.path("d2/created"), nil, 0o644))
	must(t, os.Remove(e.path("d2/h-link"))) // nlink of d/h, mtime of d2
	must(t, unix.Mkfifo(e.path("d/fifo2"), 0o600))
	want2 := mountStats(t, e.mnt)
	v2, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v2.Close()

	fa, err := os.OpenFile(e.path("d/big"), os.O_RDWR, 0)
	must(t, err)
	must(t, unix.Fallocate(int(fa.Fd()), unix.FALLOC_FL_KEEP_SIZE, 0, 1<<20))
	must(t, unix.Fallocate(int(fa.Fd()), 0, 0, 200<<10))
	must(t, fa.Close())
	now := time.Now()
	must(t, os.Chtimes(e.path("d/fifo"), now, now))
	must(t, os.Chtimes(e.path("d/sym"), now, now)) // follows: d/f
	must(t, os.Rename(e.path("d/g"), e.path("d2/g")))
	must(t, os.WriteFile(e.path("d/victim.tmp"), []byte("new"), 0o644))
	must(t, os.Rename(e.path("d/victim.tmp"), e.path("d/victim")))
	must(t, os.Remove(e.path("gone/inner")))
	must(t, os.Remove(e.path("gone")))
	must(t, os.Rename(e.path("d/sub"), e.path("d2/sub")))
	must(t, unix.Renameat2(unix.AT_FDCWD, e.path("d2/x"), unix.AT_FDCWD, e.path("d/h"), unix.RENAME_EXCHANGE))
	must(t, os.Remove(e.path("d/sym")))
	must(t, os.Symlink("elsewhere", e.path("d/sym")))
	e.write("a/one.txt", "copy-up in a copied-up directory") // mtime of a
	e.write("a/b/two.txt", "copy-up below a copied-up dir")  // mtime of a/b
	must(t, os.Remove(e.path("top.txt")))                    // a whiteout in the root
	must(t, os.Chmod(e.mnt, 0o711))                          // the root itself
	must(t, os.Chmod(e.path("d"), 0o700))

	diffStates(t, "first view", viewStats(t, v), want)
	diffStates(t, "second view", viewStats(t, v2), want2)
}
