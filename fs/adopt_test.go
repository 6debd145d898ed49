package fs

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
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
