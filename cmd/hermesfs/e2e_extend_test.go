package main

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs/testwatch"
)

// fullTree is a tree as every reader must show it: per path its kind,
// mode, owner, size, content, symlink target, mtime (seconds, files and
// symlinks), and which other path it is a hard link of.
func fullTree(t *testing.T, root string, lstat func(string) (iofs.FileInfo, error), read func(string) ([]byte, error), readlink func(string) (string, error), walk func(iofs.WalkDirFunc) error) map[string]string {
	t.Helper()
	out := map[string]string{}
	first := map[uint64]string{}
	err := walk(func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == "." || p == root {
			return nil
		}
		rel := p
		if root != "." {
			rel, _ = filepath.Rel(root, p)
		}
		fi, err := lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		s := fmt.Sprintf("%v %d:%d", fi.Mode(), st.Uid, st.Gid)
		switch {
		case fi.Mode().IsRegular():
			b, err := read(p)
			if err != nil {
				return err
			}
			h := sha256.Sum256(b)
			s += fmt.Sprintf(" %d %s %d", len(b), hex.EncodeToString(h[:8]), fi.ModTime().Unix())
			if st.Nlink > 1 {
				if f, ok := first[st.Ino]; ok {
					s += " =" + f
				} else {
					first[st.Ino] = rel
				}
			}
		case fi.Mode()&iofs.ModeSymlink != 0:
			l, err := readlink(p)
			if err != nil {
				return err
			}
			s += fmt.Sprintf(" -> %s %d", l, fi.ModTime().Unix())
		}
		out[rel] = s
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", root, err)
	}
	return out
}

func diskTree(t *testing.T, dir string) map[string]string {
	t.Helper()
	return fullTree(t, dir, os.Lstat, os.ReadFile, os.Readlink, func(fn iofs.WalkDirFunc) error { return filepath.WalkDir(dir, fn) })
}

func readerTree(t *testing.T, r *archive.Reader) map[string]string {
	t.Helper()
	fsys := r.FS()
	return fullTree(t, ".", fsys.Lstat, func(p string) ([]byte, error) { return iofs.ReadFile(fsys, p) }, r.ReadLink,
		func(fn iofs.WalkDirFunc) error { return iofs.WalkDir(fsys, ".", fn) })
}

func sameTrees(t *testing.T, what string, got, want map[string]string) {
	t.Helper()
	for p, w := range want {
		if g, ok := got[p]; !ok {
			t.Errorf("%s: missing %s", what, p)
		} else if g != w {
			t.Errorf("%s: %s is %q, want %q", what, p, g, w)
		}
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			t.Errorf("%s: %s should not be there", what, p)
		}
	}
}

// Images the daemon publishes by extending the one before, and the
// compaction of one, exported by 'hermesfs export': unsquashfs 4.5.1 and
// the kernel (mount -t squashfs) read each as our reader does (content,
// modes, owners, mtimes, symlinks, hard links), which is the tree the
// mount showed when the snapshot was taken.
func TestE2EExtendedImagesReadByEveryone(t *testing.T) {
	need(t, "/dev/fuse", "unsquashfs", "sqlite3")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	a := newHost(t, store)
	mp := e2eDir(t, "home")
	seedHome(t, mp)
	d := a.mount(mp, "--interval", "0", "--compact", "off")
	trees := map[string]map[string]string{}
	snapshot := func() string {
		t.Helper()
		code, out, errOut := a.run("snapshot", mp)
		if code != 0 {
			t.Fatalf("snapshot: exit %d %s%s", code, out, errOut)
		}
		id := strings.TrimSpace(out)
		trees[id] = diskTree(t, mp)
		return id
	}
	// Changes of every kind, a snapshot after each batch.
	appendTo(t, filepath.Join(mp, "sessions", "s003.json"), `{"turn":"more"}`)
	writeFile(t, filepath.Join(mp, "skills", "new", "SKILL.md"), "# new\n", 0o600)
	if err := os.Link(filepath.Join(mp, "sessions", "s004.json"), filepath.Join(mp, "sessions", "s004-link.json")); err != nil {
		t.Fatal(err)
	}
	snapshot()
	if err := os.Rename(filepath.Join(mp, "skills", "web"), filepath.Join(mp, "skills", "browse")); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(mp, "logs", "old.log"))
	if err := os.Chmod(filepath.Join(mp, "sessions", "s005.json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../skills/browse/SKILL.md", filepath.Join(mp, "sessions", "skill-link")); err != nil {
		t.Fatal(err)
	}
	sqlite(t, filepath.Join(mp, "state.db"), "INSERT INTO messages(body) VALUES ('third');")
	snapshot()
	writeFile(t, filepath.Join(mp, "sessions", "s001.json"), "replaced\n", 0o644) // through the symlink's target
	last := snapshot()
	d.stopOK(t)

	check := func(id string, generation int) {
		t.Helper()
		want := trees[id]
		p := filepath.Join(e2eDir(t, "export"), "image.sqfs")
		if code, out, errOut := newHost(t, store).run("export", "--snapshot", id, p); code != 0 {
			t.Fatalf("export %s: exit %d %s%s", id, code, out, errOut)
		}
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		fi, _ := f.Stat()
		r, err := archive.Open(f, fi.Size(), archive.ReaderOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Verify(t.Context()); err != nil {
			t.Fatalf("export %s: %v", id, err)
		}
		if g := r.Generation(); g != generation {
			t.Errorf("snapshot %s: generation %d, want %d", id, g, generation)
		}
		// -shm is SQLite's cache, and no snapshot's concern.
		for k := range want {
			if strings.HasSuffix(k, "-shm") {
				delete(want, k)
			}
		}
		ours := readerTree(t, r)
		for k := range ours {
			if strings.HasSuffix(k, "-shm") {
				delete(ours, k)
			}
		}
		sameTrees(t, id+" (our reader, against the mount)", ours, want)
		un := diskTree(t, unsquash(t, p))
		for k := range un {
			if strings.HasSuffix(k, "-shm") {
				delete(un, k)
			}
		}
		sameTrees(t, id+" (unsquashfs)", un, ours)
		mnt := filepath.Join(e2eDir(t, "kernel"), "mnt")
		os.MkdirAll(mnt, 0o755)
		if out, err := exec.Command("mount", "-t", "squashfs", "-o", "loop,ro", p, mnt).CombinedOutput(); err != nil {
			t.Logf("kernel squashfs mount not available here: %v: %s", err, out)
			return
		}
		defer func() {
			if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
				t.Errorf("umount: %v: %s", err, out)
			}
		}()
		k := diskTree(t, mnt)
		for p := range k {
			if strings.HasSuffix(p, "-shm") {
				delete(k, p)
			}
		}
		sameTrees(t, id+" (kernel)", k, ours)
	}
	check(last, 3) // the seed, then three extending snapshots

	// A compaction of the last one: the same tree, laid out afresh.
	d = a.mount(mp, "--interval", "0", "--compact", "extents=1")
	appendTo(t, filepath.Join(mp, "sessions", "s006.json"), `{"turn":"last"}`)
	s := snapshot()
	comp := waitCompaction(t, a, d, s)
	d.stopOK(t)
	trees[comp] = trees[s]
	check(comp, 0)
}

// snapshotCompacted takes a snapshot of h's mount d, which must pass the
// mount's compaction bound, and waits for the compaction the daemon then
// runs in the background: the ids of the snapshot and of its compaction.
// (A stop's snapshot is never compacted: a test that wants an image
// without what the changes before left unused takes one so.)
func snapshotCompacted(t *testing.T, h *host, d *daemonProc) (id, compacted string) {
	t.Helper()
	code, out, errOut := h.run("snapshot", d.mp)
	if code != 0 {
		t.Fatalf("snapshot: exit %d %s%s", code, out, errOut)
	}
	id = strings.TrimSpace(out)
	return id, waitCompaction(t, h, d, id)
}

// waitCompaction waits for the background compaction of snapshot id on
// h's mount d and returns the compacted snapshot's id.
func waitCompaction(t *testing.T, h *host, d *daemonProc, id string) string {
	t.Helper()
	defer testwatch.Wait(t, "the compaction of "+id)()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if st, _ := h.statusJSON(d.mp); st.Compaction != nil && st.Compaction.Last != nil && st.Compaction.Last.Of == id {
			return st.Compaction.Last.ID
		}
		if time.Now().After(deadline) {
			t.Fatalf("no compaction of %s in 2 minutes:\n%s", id, d.stderr)
		}
		sleepMillis(50)
	}
}

func appendTo(t *testing.T, p, line string) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(line + "\n"); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}
