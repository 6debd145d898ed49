package fs

import (
	"errors"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestReadFileLayers compares ReadFile, which reads the layers directly,
// with reads through the mount after changes that leave every kind of
// upper-layer marker: copy-up, whiteout, opaque directory, renamed lower
// directories (redirects), a hashed whiteout, names hidden and shown again.
func TestReadFileLayers(t *testing.T) {
	long := strings.Repeat("l", 253) // too long for ".wh."+name: a hashed whiteout
	lower, _ := packLower(t, func(dir string) {
		os.WriteFile(filepath.Join(dir, long), []byte("lower long"), 0o644)
		sampleTree(dir)
		os.MkdirAll(filepath.Join(dir, "skills/old/inner"), 0o755)
		os.WriteFile(filepath.Join(dir, "skills/old/inner/x.md"), []byte("lower x"), 0o644)
		os.WriteFile(filepath.Join(dir, "skills/old/y.md"), []byte("lower y"), 0o644)
		os.WriteFile(filepath.Join(dir, "config.yaml"), []byte("memory: {}\n"), 0o644)
	})
	e := mountEnv(t, lower, Options{})

	if c, err := UpperHasChanges(e.upper); c || err != nil {
		t.Fatalf("fresh upper layer: changes %v, %v", c, err)
	}
	e.write("config.yaml", "memory:\n  memory_char_limit: 100\n")          // copy-up
	must(t, os.Remove(e.path("top.txt")))                                  // whiteout
	must(t, os.RemoveAll(e.path("a/b")))                                   // whiteouts below a
	must(t, os.Mkdir(e.path("a/b"), 0o755))                                // opaque
	e.write("a/b/new.txt", "new")                                          // in the opaque dir
	must(t, os.Rename(e.path("skills/old"), e.path("skills/renamed")))     // redirect
	must(t, os.Rename(e.path("skills/renamed/inner"), e.path("t/inner2"))) // redirect, other parent
	e.write("skills/renamed/y.md", "upper y")                              // copy-up below a redirect
	must(t, os.Rename(e.path("skills/web"), e.path("skills/old")))         // a new dir where a lower one was
	must(t, os.Remove(e.path(long)))
	if c, err := UpperHasChanges(e.upper); !c || err != nil {
		t.Fatalf("changed upper layer: changes %v, %v", c, err)
	}

	paths := []string{
		"config.yaml", "top.txt", "a/one.txt", "a/one-hard.txt", "a/b/two.txt", "a/b/new.txt",
		"skills/renamed/inner/x.md", "skills/renamed/y.md", "t/inner2/x.md", "skills/old/y.md",
		"skills/old/inner/x.md", "skills/old/SKILL.md", "skills/old/sub/deep.txt", "skills/web/SKILL.md",
		"big.bin", "secret.txt", long, "nothing/here", "missing.txt",
	}
	wantContent, wantErr := map[string][]byte{}, map[string]error{}
	check := func(when string) {
		t.Helper()
		for _, p := range paths {
			got, gerr := ReadFile(e.upper, lower, p)
			var want []byte
			var werr error
			if e.m != nil {
				want, werr = os.ReadFile(e.path(p))
			} else {
				want, werr = wantContent[p], wantErr[p]
			}
			if (gerr == nil) != (werr == nil) || string(got) != string(want) {
				t.Errorf("%s: ReadFile(%s) = %.20q, %v; the mount gives %.20q, %v", when, p, got, gerr, want, werr)
				continue
			}
			if werr != nil && errors.Is(werr, iofs.ErrNotExist) != errors.Is(gerr, iofs.ErrNotExist) {
				t.Errorf("%s: ReadFile(%s): %v, the mount: %v", when, p, gerr, werr)
			}
			if e.m != nil {
				wantContent[p], wantErr[p] = want, werr
			}
		}
	}
	check("mounted")
	e.unmount()
	check("unmounted")

	// Errors for what is not a regular file, and bad paths.
	for p, want := range map[string]error{
		"link":        syscall.ELOOP,
		"a":           syscall.EISDIR,
		"a/one.txt/x": syscall.ENOTDIR,
		"fifo":        syscall.EINVAL,
		"../x":        iofs.ErrInvalid,
		"/abs":        iofs.ErrInvalid,
		".":           iofs.ErrInvalid,
		".wh.top.txt": iofs.ErrNotExist, // overlay bookkeeping is never a file of the tree
	} {
		if _, err := ReadFile(e.upper, lower, p); !errors.Is(err, want) {
			t.Errorf("ReadFile(%q): %v, want %v", p, err, want)
		}
	}
	// No lower layer, or no upper directory at all.
	if b, err := ReadFile(e.upper, nil, "config.yaml"); err != nil || string(b) != "memory:\n  memory_char_limit: 100\n" {
		t.Errorf("without lower: %q, %v", b, err)
	}
	if _, err := ReadFile(e.upper, nil, "a/one.txt"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("lower file without lower: %v", err)
	}
	none := filepath.Join(tempDir(t), "none")
	if b, err := ReadFile(none, lower, "top.txt"); err != nil || string(b) != "top" {
		t.Errorf("without upper: %q, %v", b, err)
	}
	if c, err := UpperHasChanges(none); c || err != nil {
		t.Errorf("missing upper: %v, %v", c, err)
	}
}
