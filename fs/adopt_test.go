package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

// TestAdopt takes a directory's entries into an upper layer as a mount
// would show them, then mounts it: new files and directories at their
// paths (through lower directories, copied up as they are; into a
// directory deleted in the home, which then merges nothing of the lower
// one), anything the home holds otherwise beside it, identical content
// not at all, unchanged entries (older than Since) left alone, and a
// second look after a first one adds nothing.
func TestAdopt(t *testing.T) {
	t.Parallel()
	src := tempDir(t)
	for name, content := range map[string]string{
		"same.txt":      "same",
		"differs.txt":   "home's",
		"dir/lower.txt": "lower",
		"gone/old.txt":  "deleted in the home",
		"file-here":     "a file in the home",
	} {
		must(t, os.MkdirAll(filepath.Dir(filepath.Join(src, name)), 0o755))
		must(t, os.WriteFile(filepath.Join(src, name), []byte(content), 0o644))
	}
	img := filepath.Join(tempDir(t), "lower.sqfs")
	f, err := os.Create(img)
	must(t, err)
	_, err = archive.PackDir(t.Context(), f, src, archive.PackOptions{})
	must(t, err)
	f.Close()
	lower := openLower(t, img)

	// The home: gone/ deleted, one file changed in the upper layer.
	e := mountEnv(t, lower, Options{})
	must(t, os.RemoveAll(e.path("gone")))
	e.write("home.txt", "changed in the home")
	e.unmount()

	under := tempDir(t)
	old := map[string]string{"untouched.txt": "older than Since"}
	fresh := map[string]string{
		"same.txt":            "same",
		"differs.txt":         "underneath's",
		"home.txt":            "underneath's too",
		"dir/lower.txt":       "lower",
		"dir/new.txt":         "new in a lower directory",
		"gone/new.txt":        "in a deleted directory",
		"file-here/inner.txt": "a directory where the home has a file",
		"deep/a/b/c.txt":      "deep",
		"memories/MEMORY.md":  "guarded",
	}
	for name, content := range old {
		must(t, os.WriteFile(filepath.Join(under, name), []byte(content), 0o644))
	}
	since := time.Now()
	time.Sleep(20 * time.Millisecond) // past the coarse clock's tick
	for name, content := range fresh {
		must(t, os.MkdirAll(filepath.Dir(filepath.Join(under, name)), 0o755))
		must(t, os.WriteFile(filepath.Join(under, name), []byte(content), 0o644))
	}
	must(t, os.Symlink("differs.txt", filepath.Join(under, "link")))
	must(t, os.Mkdir(filepath.Join(under, "empty"), 0o700))

	opts := AdoptOptions{Since: since, Stamp: "S", Beside: func(rel string) bool { return rel == "memories/MEMORY.md" }}
	got, err := Adopt(t.Context(), under, e.upper, lower, opts)
	must(t, err)
	var lines []string
	for _, a := range got {
		l := a.Path
		if a.From != "" {
			l = a.From + ">" + a.Path
		}
		lines = append(lines, l)
	}
	sort.Strings(lines)
	want := []string{
		"deep/a/b/c.txt", "differs.txt>differs.txt.underneath-S", "dir/new.txt", "empty/",
		"file-here/inner.txt>file-here.underneath-S/inner.txt", "gone/new.txt", "home.txt>home.txt.underneath-S",
		"link", "memories/MEMORY.md>memories/MEMORY.md.underneath-S",
	}
	if strings.Join(lines, " ") != strings.Join(want, " ") {
		t.Errorf("adopted\n got %v\nwant %v", lines, want)
	}

	e.mount()
	for name, content := range map[string]string{
		"same.txt": "same", "differs.txt": "home's", "differs.txt.underneath-S": "underneath's",
		"home.txt": "changed in the home", "home.txt.underneath-S": "underneath's too",
		"dir/lower.txt": "lower", "dir/new.txt": "new in a lower directory",
		"gone/new.txt": "in a deleted directory", "file-here": "a file in the home",
		"file-here.underneath-S/inner.txt": "a directory where the home has a file",
		"deep/a/b/c.txt":                   "deep",
		"memories/MEMORY.md.underneath-S":  "guarded",
	} {
		if got := e.read(name); got != content {
			t.Errorf("%s: %q, want %q", name, got, content)
		}
	}
	if names := e.names("gone"); strings.Join(names, " ") != "new.txt" {
		t.Errorf("a directory deleted in the home brought back its lower entries: %v", names)
	}
	e.missing("untouched.txt")
	e.missing("memories/MEMORY.md")
	if l, err := os.Readlink(e.path("link")); err != nil || l != "differs.txt" {
		t.Errorf("link: %q, %v", l, err)
	}
	if fi, err := os.Stat(e.path("empty")); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("empty directory: %v, %v", fi, err)
	}
	e.unmount()

	// A second look (as after a boot within the clock's margin) finds
	// everything taken in already, beside copies included.
	again, err := Adopt(t.Context(), under, e.upper, lower, opts)
	must(t, err)
	if len(again) != 0 {
		t.Errorf("taken in twice: %+v", again)
	}
	// The directory underneath is as it was.
	for name, content := range fresh {
		if b, err := os.ReadFile(filepath.Join(under, name)); err != nil || string(b) != content {
			t.Errorf("underneath %s: %q, %v", name, b, err)
		}
	}
}

// countingLower counts the lookups and listings of the lower layer.
type countingLower struct {
	Lower
	n atomic.Int64
}

func (c *countingLower) Lookup(dir archive.Inode, name string) (archive.Attr, error) {
	c.n.Add(1)
	return c.Lower.Lookup(dir, name)
}

func (c *countingLower) ReadDir(dir archive.Inode) ([]archive.DirEntry, error) {
	c.n.Add(1)
	return c.Lower.ReadDir(dir)
}

// What lies underneath unchanged since the last look (the home a first
// snapshot was packed from, under every later mount) is found unchanged
// by its stats alone: Adopt resolves in the merged tree only the
// directories on the way to what changed, however many there are.
func TestAdoptLooksOnlyAtWhatChanged(t *testing.T) {
	t.Parallel()
	under := tempDir(t)
	for i := range 60 {
		for j := range 5 {
			p := filepath.Join(under, "pkgs", fmt.Sprintf("p%02d", i), "lib", fmt.Sprintf("m%d.py", j))
			must(t, os.MkdirAll(filepath.Dir(p), 0o755))
			must(t, os.WriteFile(p, []byte(p), 0o644))
		}
	}
	img := filepath.Join(tempDir(t), "lower.sqfs")
	f, err := os.Create(img)
	must(t, err)
	_, err = archive.PackDir(t.Context(), f, under, archive.PackOptions{})
	must(t, err)
	f.Close()
	lower := &countingLower{Lower: openLower(t, img)}
	upper := tempDir(t)

	since := time.Now()
	time.Sleep(20 * time.Millisecond) // past the coarse clock's tick
	changed := filepath.Join(under, "pkgs", "p41", "lib", "m3.py")
	must(t, os.WriteFile(changed, []byte("written underneath"), 0o644))

	got, err := Adopt(t.Context(), under, upper, lower, AdoptOptions{Since: since, Stamp: "S"})
	must(t, err)
	if len(got) != 1 || got[0].From != "pkgs/p41/lib/m3.py" {
		t.Fatalf("adopted %+v; want the one file changed, beside the lower one", got)
	}
	if n := lower.n.Load(); n > 40 {
		t.Errorf("%d lookups and listings of the lower layer for one changed file in %d unchanged directories", n, 60*2+1)
	}
}

// TestChangedUnderneath: a directory holds something Adopt would look at
// when an entry changed at Since or after (a directory whose entries
// changed counts), nothing when all are older; zero Since counts every
// entry.
func TestChangedUnderneath(t *testing.T) {
	t.Parallel()
	under := tempDir(t)
	must(t, os.MkdirAll(filepath.Join(under, "deep", "x"), 0o755))
	must(t, os.WriteFile(filepath.Join(under, "deep", "x", "y.txt"), []byte("old"), 0o644))
	must(t, os.WriteFile(filepath.Join(under, "a.txt"), []byte("old"), 0o644))
	// since: a ctime past every entry's (the coarse clock ticks on).
	var since time.Time
	newest := ctimeOf(t, filepath.Join(under, "deep", "x", "y.txt"))
	for _, p := range []string{under, filepath.Join(under, "deep"), filepath.Join(under, "deep", "x"), filepath.Join(under, "a.txt")} {
		if c := ctimeOf(t, p); c.After(newest) {
			newest = c
		}
	}
	deadline := time.Now().Add(time.Minute)
	for !since.After(newest) {
		mark := filepath.Join(tempDir(t), "mark")
		must(t, os.WriteFile(mark, nil, 0o600))
		since = ctimeOf(t, mark)
		if time.Now().After(deadline) {
			t.Fatal("the file system's ctime did not move on within a minute")
		}
	}
	check := func(when time.Time, want bool, what string) {
		t.Helper()
		got, err := ChangedUnderneath(t.Context(), under, when)
		must(t, err)
		if got != want {
			t.Errorf("%s: ChangedUnderneath = %v, want %v", what, got, want)
		}
	}
	check(time.Time{}, true, "zero since")
	check(since, false, "nothing changed since")
	must(t, os.WriteFile(filepath.Join(under, "deep", "gone"), nil, 0o600))
	must(t, os.Remove(filepath.Join(under, "deep", "gone"))) // deep's ctime moves
	check(since, true, "an entry removed from a directory (its ctime moved)")
}

// TestChangedUnderneathDeepFile: a file rewritten deep below unchanged
// directories is found.
func TestChangedUnderneathDeepFile(t *testing.T) {
	t.Parallel()
	under := tempDir(t)
	y := filepath.Join(under, "deep", "x", "y.txt")
	must(t, os.MkdirAll(filepath.Dir(y), 0o755))
	must(t, os.WriteFile(y, []byte("old"), 0o644))
	since := ctimeOf(t, y).Add(time.Nanosecond)
	for _, p := range []string{under, filepath.Join(under, "deep"), filepath.Dir(y)} {
		if !ctimeOf(t, p).Before(since) {
			since = ctimeOf(t, p).Add(time.Nanosecond)
		}
	}
	got, err := ChangedUnderneath(t.Context(), under, since)
	must(t, err)
	if got {
		t.Fatal("nothing changed, yet ChangedUnderneath says so")
	}
	deadline := time.Now().Add(time.Minute)
	for !ctimeOf(t, y).After(since) {
		must(t, os.WriteFile(y, []byte("new"), 0o644))
		if time.Now().After(deadline) {
			t.Fatal("the file system's ctime did not move on within a minute")
		}
	}
	for _, p := range []string{under, filepath.Join(under, "deep"), filepath.Dir(y)} {
		if !ctimeOf(t, p).Before(since) {
			t.Fatalf("%s changed too: the test would not tell a deep file from its directory", p)
		}
	}
	got, err = ChangedUnderneath(t.Context(), under, since)
	must(t, err)
	if !got {
		t.Fatal("a file rewritten below unchanged directories was missed")
	}
}

func ctimeOf(t *testing.T, p string) time.Time {
	t.Helper()
	var st syscall.Stat_t
	must(t, syscall.Lstat(p, &st))
	return time.Unix(st.Ctim.Sec, st.Ctim.Nsec)
}
