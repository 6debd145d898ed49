package browse_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/browse"
	"github.com/hermesfs/hermesfs/fs/mounttest"
)

var testRoot string

func TestMain(m *testing.M) { mounttest.Main(m, "hermesfs-browse", &testRoot) }

func needFUSE(t *testing.T) {
	t.Helper()
	if _, err := os.Stat("/dev/fuse"); err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") == "1" {
			t.Fatalf("no /dev/fuse: %v", err)
		}
		t.Skipf("no /dev/fuse: %v", err)
	}
}

func tempDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp(testRoot, "t-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

// fakeSource serves archives packed from local trees and counts opens.
type fakeSource struct {
	mu     sync.Mutex
	snaps  []browse.Snapshot
	files  map[string]string // id -> archive path
	opened map[string]int
}

func (s *fakeSource) Snapshots(ctx context.Context) ([]browse.Snapshot, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.snaps), nil
}

func (s *fakeSource) Open(ctx context.Context, id string) (fs.Lower, error) {
	s.mu.Lock()
	path := s.files[id]
	s.opened[id]++
	s.mu.Unlock()
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	return archive.Open(f, st.Size(), archive.ReaderOptions{Name: id})
}

func (s *fakeSource) opens() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.opened {
		n += c
	}
	return n
}

func (s *fakeSource) count(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.opened[id]
}

// add packs dir as snapshot id.
func (s *fakeSource) add(t *testing.T, id string, created time.Time, dir string, latest bool) {
	t.Helper()
	p := filepath.Join(tempDir(t), "a.sqfs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := archive.Pack(t.Context(), f, os.DirFS(dir), archive.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := range s.snaps {
		s.snaps[i].Latest = s.snaps[i].Latest && !latest
	}
	s.snaps = append(s.snaps, browse.Snapshot{ID: id, Created: created, Latest: latest})
	s.files[id] = p
}

// makeTree writes a small home with a file, a nested dir, a symlink and a
// hard link; version changes the content.
func makeTree(t *testing.T, version int) string {
	t.Helper()
	d := tempDir(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(d, "memories"), 0o755))
	must(os.WriteFile(filepath.Join(d, "memories", "MEMORY.md"), []byte(fmt.Sprintf("note %d\n§\nmore\n", version)), 0o644))
	must(os.WriteFile(filepath.Join(d, "big.bin"), bytes.Repeat([]byte(fmt.Sprintf("block %d ", version)), 40000), 0o600))
	must(os.Symlink("memories/MEMORY.md", filepath.Join(d, "link")))
	must(os.Link(filepath.Join(d, "big.bin"), filepath.Join(d, "hard.bin")))
	must(os.Mkdir(filepath.Join(d, "empty"), 0o700))
	return d
}

func mount(t *testing.T, src browse.Source, refresh time.Duration) string {
	t.Helper()
	needFUSE(t)
	mp := tempDir(t)
	m, err := browse.Mount(t.Context(), mp, browse.Options{Source: src, RefreshAfter: refresh})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := m.Unmount(ctx); err != nil {
			t.Error(err)
		}
	})
	return mp
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	slices.Sort(out)
	return out
}

const (
	id1 = "20261124T101500.000Z-box-00000001"
	id2 = "20261124T101530.000Z-box-00000002"
	id3 = "20261125T080000.000Z-box-00000003"
)

func TestBrowseListsWithoutOpening(t *testing.T) {
	src := &fakeSource{files: map[string]string{}, opened: map[string]int{}}
	trees := map[string]string{}
	for i, id := range []string{id1, id2, id3} {
		tm, _ := time.Parse("20060102T150405.000Z", id[:20])
		trees[id] = makeTree(t, i)
		src.add(t, id, tm, trees[id], id == id2) // LATEST need not be the newest
	}
	mp := mount(t, src, time.Hour)

	want := []string{"2026-11-24T1015", "2026-11-24T1015-2", "2026-11-25T0800", id1, id2, id3, "latest"}
	if got := names(t, mp); !slices.Equal(got, want) {
		t.Fatalf("root lists %v, want %v", got, want)
	}
	for _, n := range want {
		if _, err := os.Lstat(filepath.Join(mp, n)); err != nil {
			t.Fatal(err)
		}
	}
	for alias, id := range map[string]string{"latest": id2, "2026-11-24T1015": id1, "2026-11-24T1015-2": id2, "2026-11-25T0800": id3} {
		if got, err := os.Readlink(filepath.Join(mp, alias)); err != nil || got != id {
			t.Errorf("%s -> %q, %v; want %s", alias, got, err, id)
		}
	}
	st, err := os.Stat(filepath.Join(mp, id3))
	if err != nil || !st.IsDir() || !st.ModTime().Equal(time.Date(2026, 11, 25, 8, 0, 0, 0, time.UTC)) {
		t.Fatalf("snapshot dir before entering: %v, %v", st, err)
	}
	if n := src.opens(); n != 0 {
		t.Fatalf("listing the root and stat-ing its entries opened %d archives", n)
	}

	// Entering one opens that one only, once.
	got := names(t, filepath.Join(mp, "latest"))
	if want := []string{"big.bin", "empty", "hard.bin", "link", "memories"}; !slices.Equal(got, want) {
		t.Fatalf("latest lists %v, want %v", got, want)
	}
	b, err := os.ReadFile(filepath.Join(mp, id1, "memories", "MEMORY.md"))
	if err != nil || string(b) != "note 0\n§\nmore\n" {
		t.Fatalf("read MEMORY.md of %s: %q, %v", id1, b, err)
	}
	if n1, n2, n3 := src.count(id1), src.count(id2), src.count(id3); n1 != 1 || n2 != 1 || n3 != 0 {
		t.Fatalf("opens: %d %d %d, want 1 1 0", n1, n2, n3)
	}

	// diff -r against the tree it was packed from; cp -a reproduces it.
	if out, err := exec.Command("diff", "-r", "--no-dereference", filepath.Join(mp, id3), trees[id3]).CombinedOutput(); err != nil {
		t.Fatalf("diff -r snapshot tree: %v\n%s", err, out)
	}
	dst := filepath.Join(tempDir(t), "copy")
	if out, err := exec.Command("cp", "-a", filepath.Join(mp, "latest")+"/", dst).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v\n%s", err, out)
	}
	if out, err := exec.Command("diff", "-r", "--no-dereference", dst, trees[id2]).CombinedOutput(); err != nil {
		t.Fatalf("diff -r copy: %v\n%s", err, out)
	}
	a, _ := os.Stat(filepath.Join(mp, id2, "big.bin"))
	h, _ := os.Stat(filepath.Join(mp, id2, "hard.bin"))
	if !os.SameFile(a, h) || a.Sys().(*syscall.Stat_t).Nlink != 2 {
		t.Error("hard links are not one inode")
	}
	s1, _ := os.Stat(filepath.Join(mp, id1, "big.bin"))
	if os.SameFile(s1, a) {
		t.Error("files of two snapshots share an inode number")
	}
}

func TestBrowseIsReadOnly(t *testing.T) {
	src := &fakeSource{files: map[string]string{}, opened: map[string]int{}}
	src.add(t, id1, time.Now(), makeTree(t, 1), true)
	mp := mount(t, src, time.Hour)
	snap := filepath.Join(mp, id1)
	file := filepath.Join(snap, "memories", "MEMORY.md")
	for name, op := range map[string]func() error{
		"write":        func() error { return os.WriteFile(file, []byte("x"), 0o644) },
		"open rw":      func() error { f, err := os.OpenFile(file, os.O_RDWR, 0); f.Close(); return err },
		"create":       func() error { return os.WriteFile(filepath.Join(snap, "new"), nil, 0o644) },
		"create root":  func() error { return os.WriteFile(filepath.Join(mp, "new"), nil, 0o644) },
		"mkdir":        func() error { return os.Mkdir(filepath.Join(snap, "d"), 0o755) },
		"remove":       func() error { return os.Remove(file) },
		"rmdir":        func() error { return os.Remove(filepath.Join(snap, "empty")) },
		"remove alias": func() error { return os.Remove(filepath.Join(mp, "latest")) },
		"rename":       func() error { return os.Rename(file, file+".old") },
		"chmod":        func() error { return os.Chmod(file, 0o600) },
		"truncate":     func() error { return os.Truncate(file, 0) },
		"symlink":      func() error { return os.Symlink("x", filepath.Join(snap, "l")) },
		"utimes":       func() error { return os.Chtimes(file, time.Now(), time.Now()) },
	} {
		if err := op(); !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s: %v, want EROFS", name, err)
		}
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "note 1\n§\nmore\n" {
		t.Fatalf("content after the refused writes: %q, %v", b, err)
	}
}

func TestBrowseFollowsTheCatalog(t *testing.T) {
	src := &fakeSource{files: map[string]string{}, opened: map[string]int{}}
	src.add(t, id1, time.Date(2026, 11, 24, 10, 15, 0, 0, time.UTC), makeTree(t, 1), true)
	mp := mount(t, src, time.Nanosecond)
	if got, _ := os.Readlink(filepath.Join(mp, "latest")); got != id1 {
		t.Fatalf("latest -> %q", got)
	}
	src.add(t, id3, time.Date(2026, 11, 25, 8, 0, 0, 0, time.UTC), makeTree(t, 3), true)
	// A name not listed yet is found (the lookup lists the catalog again).
	if _, err := os.Stat(filepath.Join(mp, id3, "memories")); err != nil {
		t.Fatal(err)
	}
	if got := names(t, mp); !slices.Contains(got, id3) || !slices.Contains(got, "2026-11-25T0800") {
		t.Fatalf("new snapshot not listed: %v", got)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		// The kernel may keep the link's old target for its attribute
		// timeout.
		got, _ := os.Readlink(filepath.Join(mp, "latest"))
		if got == id3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("latest still -> %q", got)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if _, err := os.Stat(filepath.Join(mp, "20261124T101500.000Z-box-99999999")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("unknown id: %v", err)
	}
}

func TestBrowseUnreadableSnapshot(t *testing.T) {
	src := &fakeSource{files: map[string]string{}, opened: map[string]int{}}
	src.add(t, id1, time.Now(), makeTree(t, 1), true)
	src.mu.Lock()
	good := src.files[id1]
	src.files[id1] = filepath.Join(tempDir(t), "gone.sqfs")
	src.mu.Unlock()
	mp := mount(t, src, time.Hour)
	if _, err := os.ReadDir(filepath.Join(mp, id1)); !errors.Is(err, syscall.EIO) {
		t.Fatalf("entering a snapshot that cannot be opened: %v, want EIO", err)
	}
	// A failed open is tried again.
	src.mu.Lock()
	src.files[id1] = good
	src.mu.Unlock()
	if got := names(t, filepath.Join(mp, id1)); !slices.Contains(got, "memories") {
		t.Fatalf("after the archive came back: %v", got)
	}
	if n := src.count(id1); n != 2 {
		t.Fatalf("%d opens, want 2", n)
	}
}
