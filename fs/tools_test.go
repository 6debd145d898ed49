package fs

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestRealTools runs everyday tools on the mount: git (lock files with
// O_EXCL, renames, link(2) for objects, fsck of the result), tar
// extraction with modes and mtimes kept, and cp -a of a lower tree, with a
// freeze in the middle whose view must match the tree it froze.
func TestRealTools(t *testing.T) {
	git := needTool(t, "git")
	tar := needTool(t, "tar")
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	run := func(dir string, name string, args ...string) string {
		t.Helper()
		cmd := exec.Command(name, args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@t", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@t", "HOME="+tempDir(t))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
		return string(out)
	}

	// A repository made on the mount, committed to, cloned and checked.
	repo := e.path("skills/repo")
	os.MkdirAll(repo, 0o755)
	run(repo, git, "init", "-q", "-b", "main")
	for i := 0; i < 20; i++ {
		os.WriteFile(filepath.Join(repo, "f"+strings.Repeat("x", i%5)), []byte(strings.Repeat("line\n", i+1)), 0o644)
		run(repo, git, "add", "-A")
		run(repo, git, "commit", "-q", "-m", "c")
	}
	run(repo, git, "gc", "-q")
	run(e.mnt, git, "clone", "-q", "--no-local", repo, e.path("clone"))
	run(e.path("clone"), git, "fsck", "--strict", "--no-progress")

	// A tree extracted with tar from an archive of the lower tree, with
	// a freeze taken before it.
	tarball := filepath.Join(tempDir(t), "t.tar")
	run(e.mnt, tar, "cf", tarball, "a", "skills/web", "link", "big.bin")
	os.Mkdir(e.path("x"), 0o755)
	want := stateOfDir(t, e.mnt)
	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	run(e.path("x"), tar, "xpf", tarball)
	for _, p := range []string{"a/one.txt", "skills/web/SKILL.md", "big.bin"} {
		a, _ := os.ReadFile(e.path(p))
		b, _ := os.ReadFile(e.path("x/" + p))
		if string(a) != string(b) {
			t.Errorf("tar round trip of %s differs", p)
		}
		sa, sb := lstat(t, e.path(p)), lstat(t, e.path("x/"+p))
		if sa.Mtim != sb.Mtim || sa.Mode != sb.Mode {
			t.Errorf("%s: tar kept mtime %v mode %o, want %v %o", p, sb.Mtim, sb.Mode, sa.Mtim, sa.Mode)
		}
	}
	run(e.mnt, "cp", "-a", "skills", "skills-copy")
	run(e.mnt, "rm", "-rf", "skills/repo/.git")
	diffStates(t, "view after tar, cp and rm", stateOfFS(t, v), want)
}
