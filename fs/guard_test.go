package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// testGuard guards memories/*.md: content over max bytes is EFBIG,
// content containing "BAD" is EPERM. It records every Check.
type testGuard struct {
	max int
	mu  sync.Mutex
	log []checkCall
}

type checkCall struct {
	rel      string
	old, new string
	oldNil   bool
	pid      uint32
}

func (g *testGuard) Guarded(rel string) bool {
	return strings.HasPrefix(rel, "memories/") && strings.HasSuffix(rel, ".md") && strings.Count(rel, "/") == 1
}

func (g *testGuard) Check(ctx context.Context, rel string, old, new []byte, pid uint32) error {
	g.mu.Lock()
	g.log = append(g.log, checkCall{rel: rel, old: string(old), new: string(new), oldNil: old == nil, pid: pid})
	g.mu.Unlock()
	switch {
	case bytes.Contains(new, []byte("BAD")):
		return fmt.Errorf("blocked content: %w", syscall.EPERM)
	case len(new) > g.max:
		return fmt.Errorf("over the limit: %w", syscall.EFBIG)
	}
	return nil
}

func (g *testGuard) calls() []checkCall {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]checkCall(nil), g.log...)
}

func (g *testGuard) reset() {
	g.mu.Lock()
	g.log = nil
	g.mu.Unlock()
}

func guardEnv(t *testing.T) (*env, *testGuard) {
	lower, _ := packLower(t, func(dir string) {
		os.MkdirAll(filepath.Join(dir, "memories"), 0o755)
		os.WriteFile(filepath.Join(dir, "memories/MEMORY.md"), []byte("lower memory"), 0o644)
		os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("free text"), 0o644)
	})
	g := &testGuard{max: 64}
	return mountEnv(t, lower, Options{Guard: g}), g
}

// writeClose writes data to path with flags and returns the error of
// close(2), which is where a guarded write is judged.
func writeClose(path string, flags int, data string) (writeErr, closeErr error) {
	fd, err := unix.Open(path, flags|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return err, nil
	}
	if _, err := unix.Write(fd, []byte(data)); err != nil {
		writeErr = err
	}
	return writeErr, unix.Close(fd)
}

func TestGuardCloseVerdicts(t *testing.T) {
	e, g := guardEnv(t)
	mem := e.path("memories/MEMORY.md")
	ino := e.ino("memories/MEMORY.md")

	// Accepted: visible at close, same inode.
	if _, err := writeClose(mem, unix.O_WRONLY|unix.O_TRUNC, "fact one"); err != nil {
		t.Fatalf("accepted write: close: %v", err)
	}
	if got := e.read("memories/MEMORY.md"); got != "fact one" {
		t.Fatalf("after accepted write: %q", got)
	}
	if e.ino("memories/MEMORY.md") != ino {
		t.Errorf("st_ino changed by a guarded commit")
	}
	c := g.calls()
	if len(c) != 1 || c[0].rel != "memories/MEMORY.md" || c[0].old != "lower memory" || c[0].new != "fact one" || c[0].pid == 0 {
		t.Errorf("checks: %+v", c)
	}

	// Rejected for size and for content: close fails, old content stays.
	for _, tc := range []struct {
		data string
		want syscall.Errno
	}{{strings.Repeat("x", 100), syscall.EFBIG}, {"this is BAD", syscall.EPERM}} {
		if _, err := writeClose(mem, unix.O_WRONLY|unix.O_TRUNC, tc.data); !errors.Is(err, tc.want) {
			t.Errorf("close after %q: %v, want %v", tc.data[:8], err, tc.want)
		}
		if got := e.read("memories/MEMORY.md"); got != "fact one" {
			t.Errorf("after rejection: %q", got)
		}
	}

	// Appends are staged on top of the current content.
	if _, err := writeClose(mem, unix.O_WRONLY|unix.O_APPEND, "\n§\nfact two"); err != nil {
		t.Fatal(err)
	}
	if got := e.read("memories/MEMORY.md"); got != "fact one\n§\nfact two" {
		t.Errorf("after append: %q", got)
	}
	// A new guarded file: old is nil.
	g.reset()
	if _, err := writeClose(e.path("memories/USER.md"), unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL, "user"); err != nil {
		t.Fatal(err)
	}
	if c := g.calls(); len(c) != 1 || !c[0].oldNil || c[0].new != "user" {
		t.Errorf("new file check: %+v", c)
	}
	// Other files are never checked.
	g.reset()
	e.write("notes.txt", strings.Repeat("BAD ", 100))
	e.write("memories/notes.txt", "BAD")
	if c := g.calls(); len(c) != 0 {
		t.Errorf("unguarded files were checked: %+v", c)
	}
	e.remount()
	if got := e.read("memories/MEMORY.md"); got != "fact one\n§\nfact two" {
		t.Errorf("after remount: %q", got)
	}
	if e.ino("memories/MEMORY.md") != ino {
		t.Errorf("st_ino changed across remount")
	}
}

// TestGuardReadersSeeWholeVersions: while a writer stages, readers see the
// committed content; a reader never sees a partial file.
func TestGuardReadersSeeWholeVersions(t *testing.T) {
	e, _ := guardEnv(t)
	mem := e.path("memories/MEMORY.md")
	fd, err := unix.Open(mem, unix.O_RDWR|unix.O_TRUNC, 0)
	if err != nil {
		t.Fatal(err)
	}
	unix.Write(fd, []byte("half"))
	if got := e.read("memories/MEMORY.md"); got != "lower memory" {
		t.Errorf("reader during staging: %q", got)
	}
	// The writer reads its own bytes.
	buf := make([]byte, 10)
	if k, _ := unix.Pread(fd, buf, 0); string(buf[:k]) != "half" {
		t.Errorf("writer reads %q", buf[:k])
	}
	unix.Write(fd, []byte(" and whole"))
	if err := unix.Close(fd); err != nil {
		t.Fatal(err)
	}
	if got := e.read("memories/MEMORY.md"); got != "half and whole" {
		t.Errorf("after commit: %q", got)
	}
	// Shared writable mmap cannot go around the staging.
	f, err := os.OpenFile(mem, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Mmap(int(f.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		t.Error("shared writable mmap of a guarded file succeeded")
	}
	f.Close()
}

// TestGuardRename: a file renamed over a guarded name is checked first
// (Hermes' temp + fsync + rename), as are directories that bring one.
func TestGuardRename(t *testing.T) {
	e, g := guardEnv(t)
	mem := e.path("memories/MEMORY.md")
	tmp := e.path("memories/.tmp_123.tmp")
	if err := atomicWrite(mem, []byte("via rename")); err != nil {
		t.Fatalf("accepted rename: %v", err)
	}
	if got := e.read("memories/MEMORY.md"); got != "via rename" {
		t.Errorf("after rename: %q", got)
	}
	c := g.calls()
	if len(c) != 1 || c[0].old != "lower memory" || c[0].new != "via rename" {
		t.Errorf("checks: %+v", c)
	}
	os.WriteFile(tmp, []byte("BAD idea"), 0o600)
	if err := os.Rename(tmp, mem); !errors.Is(err, syscall.EPERM) {
		t.Errorf("rename of blocked content: %v", err)
	}
	if got := e.read("memories/MEMORY.md"); got != "via rename" {
		t.Errorf("after rejected rename: %q", got)
	}
	os.WriteFile(tmp, []byte(strings.Repeat("y", 65)), 0o600)
	if err := os.Rename(tmp, mem); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("rename of oversized content: %v", err)
	}
	// A directory that brings a guarded file is checked too.
	os.MkdirAll(e.path("staging"), 0o755)
	os.WriteFile(e.path("staging/MEMORY.md"), []byte("BAD dir"), 0o644)
	os.Rename(e.path("memories"), e.path("old-memories"))
	if err := os.Rename(e.path("staging"), e.path("memories")); !errors.Is(err, syscall.EPERM) {
		t.Errorf("rename of a directory bringing blocked content: %v", err)
	}
	os.WriteFile(e.path("staging/MEMORY.md"), []byte("fine"), 0o644)
	if err := os.Rename(e.path("staging"), e.path("memories")); err != nil {
		t.Errorf("rename of a directory bringing fine content: %v", err)
	}
	if got := e.read("memories/MEMORY.md"); got != "fine" {
		t.Errorf("moved in: %q", got)
	}
	// A file still open for writing cannot become a guarded file.
	w, _ := os.Create(e.path("open.md"))
	defer w.Close()
	if err := os.Rename(e.path("open.md"), e.path("memories/USER.md")); !errors.Is(err, syscall.EBUSY) {
		t.Errorf("rename of a file open for writing: %v", err)
	}
}

// TestGuardTruncateLinksSymlinks covers the other ways to change a guarded
// name.
func TestGuardTruncateLinksSymlinks(t *testing.T) {
	e, g := guardEnv(t)
	mem := e.path("memories/MEMORY.md")
	if err := os.Truncate(mem, 5); err != nil {
		t.Fatal(err)
	}
	if got := e.read("memories/MEMORY.md"); got != "lower" {
		t.Errorf("after truncate: %q", got)
	}
	if c := g.calls(); len(c) != 1 || c[0].new != "lower" {
		t.Errorf("truncate checks: %+v", c)
	}
	if err := os.Truncate(mem, 1000); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("truncate past the limit: %v", err)
	}
	if err := os.Symlink("/etc/passwd", e.path("memories/USER.md")); !errors.Is(err, syscall.EPERM) {
		t.Errorf("symlink at a guarded name: %v", err)
	}
	if err := os.Link(mem, e.path("alias")); !errors.Is(err, syscall.EPERM) {
		t.Errorf("hard link to a guarded file: %v", err)
	}
	e.write("x.md", "x")
	if err := os.Link(e.path("x.md"), e.path("memories/USER.md")); !errors.Is(err, syscall.EPERM) {
		t.Errorf("hard link at a guarded name: %v", err)
	}
	// Deleting a guarded file is not a content change.
	if err := os.Remove(mem); err != nil {
		t.Errorf("remove: %v", err)
	}
}

// TestGuardShellWriters: writers that are not Hermes (a shell redirect, an
// append) go through the same hook.
func TestGuardShellWriters(t *testing.T) {
	e, _ := guardEnv(t)
	mem := e.path("memories/MEMORY.md")
	// The shell does not check close(2): the content must simply stay.
	exec.Command("sh", "-c", "echo 'BAD stuff' > "+mem).Run()
	if got := e.read("memories/MEMORY.md"); got != "lower memory" {
		t.Errorf("after rejected redirect: %q", got)
	}
	if out, err := exec.Command("sh", "-c", "printf ' more' >> "+mem).CombinedOutput(); err != nil {
		t.Errorf("append: %v %s", err, out)
	}
	if got := e.read("memories/MEMORY.md"); got != "lower memory more" {
		t.Errorf("after append: %q", got)
	}
	if out, err := exec.Command("sh", "-c", "echo fresh > "+mem).CombinedOutput(); err != nil {
		t.Errorf("redirect: %v %s", err, out)
	}
	if got := e.read("memories/MEMORY.md"); got != "fresh\n" {
		t.Errorf("after redirect: %q", got)
	}
	// An open with O_TRUNC and no write empties the file at release,
	// which the kernel sends after close(2) returns.
	if _, err := writeClose(mem, unix.O_WRONLY|unix.O_TRUNC, ""); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for e.read("memories/MEMORY.md") != "" {
		if time.Now().After(deadline) {
			t.Fatalf("after truncating open: %q", e.read("memories/MEMORY.md"))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// writeCheckGuard also refuses writes early (GuardWriteChecker).
type writeCheckGuard struct{ testGuard }

func (g *writeCheckGuard) CheckWrite(rel string, old, content []byte, appendOnly bool) error {
	if len(content) > g.max {
		return fmt.Errorf("over the limit: %w", syscall.EFBIG)
	}
	return nil
}

// TestGuardEarlyRefusals: with a GuardWriteChecker, a shell append past the
// limit fails the write (and so the shell); a refused creation leaves no
// file behind.
func TestGuardEarlyRefusals(t *testing.T) {
	g := &writeCheckGuard{testGuard{max: 64}}
	e := mountEnv(t, nil, Options{Guard: g})
	os.Mkdir(e.path("memories"), 0o755)
	e.write("memories/MEMORY.md", "base")
	mem := e.path("memories/MEMORY.md")
	out, err := exec.Command("sh", "-c", "echo "+strings.Repeat("x", 100)+" >> "+mem).CombinedOutput()
	if err == nil {
		t.Errorf("shell append past the limit exited 0 (%q)", out)
	}
	if got := e.read("memories/MEMORY.md"); got != "base" {
		t.Errorf("after refused append: %q", got)
	}
	// Within the limit, writes pass and close commits.
	if out, err := exec.Command("sh", "-c", "echo more >> "+mem).CombinedOutput(); err != nil {
		t.Errorf("append within the limit: %v %s", err, out)
	}
	if got := e.read("memories/MEMORY.md"); got != "basemore\n" {
		t.Errorf("after append: %q", got)
	}
	// A refused write poisons its handle: the accepted write before it is
	// not committed either (no half entry), and close fails too.
	f, err := os.OpenFile(mem, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString("half"); err != nil {
		t.Errorf("write within the limit: %v", err)
	}
	if _, err := f.WriteString(strings.Repeat("y", 100)); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("write past the limit: %v, want EFBIG", err)
	}
	if err := f.Close(); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("close after a refused write: %v, want EFBIG", err)
	}
	if got := e.read("memories/MEMORY.md"); got != "basemore\n" {
		t.Errorf("after a refused write: %q, want the content before the handle", got)
	}

	// A creation whose content the Guard refuses at close leaves no file.
	user := e.path("memories/USER.md")
	if _, err := writeClose(user, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL, "BAD"); !errors.Is(err, syscall.EPERM) {
		t.Errorf("refused creation: close %v", err)
	}
	if _, err := os.Stat(user); !os.IsNotExist(err) {
		t.Errorf("refused creation left the file: %v", err)
	}
	if got := e.names("memories"); len(got) != 1 {
		t.Errorf("memories lists %v", got)
	}
}

// TestGuardReadersFollowCommits: a guarded commit renames a new file over
// the old one, but a reader opened before it reads one file, as on a disk:
// it must see (and fstat) the committed content. The kernel also answers a
// GETATTR without a handle through any open handle of the node, so a stale
// reader would cut a newer reader's view to the old size.
func TestGuardReadersFollowCommits(t *testing.T) {
	e, _ := guardEnv(t)
	mem := e.path("memories/MEMORY.md")
	fromLower, err := os.Open(mem) // opened while the file is only in the lower layer
	if err != nil {
		t.Fatal(err)
	}
	defer fromLower.Close()
	if _, err := writeClose(mem, unix.O_WRONLY|unix.O_TRUNC, "one"); err != nil {
		t.Fatal(err)
	}
	fromUpper, err := os.Open(mem) // opened on the first committed version
	if err != nil {
		t.Fatal(err)
	}
	defer fromUpper.Close()
	for round, want := range []string{"second, longer", "third version, longer still"} {
		if _, err := writeClose(mem, unix.O_WRONLY|unix.O_TRUNC, want); err != nil {
			t.Fatal(err)
		}
		for _, f := range []*os.File{fromLower, fromUpper} {
			buf := make([]byte, 100)
			k, err := f.ReadAt(buf, 0)
			if err != nil && err != io.EOF {
				t.Fatalf("round %d: %s: read: %v", round, f.Name(), err)
			}
			if got := string(buf[:k]); got != want {
				t.Errorf("round %d: reader opened earlier read %q, want %q", round, got, want)
			}
			var st unix.Stat_t
			if err := unix.Fstat(int(f.Fd()), &st); err != nil {
				t.Fatal(err)
			}
			if st.Size != int64(len(want)) {
				t.Errorf("round %d: fstat of a reader opened earlier: size %d, want %d", round, st.Size, len(want))
			}
		}
		if got := e.read("memories/MEMORY.md"); got != want {
			t.Errorf("round %d: a new reader read %q, want %q", round, got, want)
		}
	}
}
