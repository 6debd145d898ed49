package daemon

import (
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// snapshotImage restores snapshot id of the local store dir and opens its
// archive.
func snapshotImage(t *testing.T, store, id string) *archive.Reader {
	t.Helper()
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(tempDir(t), id+".sqfs")
	if _, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}).Restore(t.Context(), dst, uploader.RestoreOptions{ID: id, Image: image.Opener(s, nil, "")}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(dst)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	r, err := archive.Open(f, fi.Size(), archive.ReaderOptions{Name: id})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Verify(t.Context()); err != nil {
		t.Fatalf("snapshot %s: %v", id, err)
	}
	return r
}

// requestSnapshot takes a snapshot on the control socket of state and
// returns its id.
func requestSnapshot(t *testing.T, state string) snapshotResult {
	t.Helper()
	resp, err := ControlCall(t.Context(), filepath.Join(state, "control.sock"), controlRequest{Op: "snapshot"})
	if err != nil || resp.Error != "" || resp.Snapshot == nil || resp.Snapshot.ID == "" {
		t.Fatalf("snapshot on the control socket: %+v, %v", resp, err)
	}
	return *resp.Snapshot
}

func inoOf(t *testing.T, r *archive.Reader, p string) archive.Inode {
	t.Helper()
	fi, err := r.FS().Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return archive.Inode(fi.Sys().(*syscall.Stat_t).Ino)
}

func stIno(t *testing.T, p string) uint64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// appendLine appends one line to the file at p.
func appendLine(t *testing.T, p, line string) {
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

// Snapshots extend the image before them: the seed, then each one-line
// change, across a clean restart (which rebases onto the last snapshot)
// and a restart of a state dir that still has its upper layer. Every image
// is read whole and checked; unchanged and changed files keep their inode
// numbers in the images and, across the restarts, through the mount.
func TestRunSnapshotsExtend(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	if err := os.Mkdir(store, 0o700); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		d := filepath.Join(mp, "agent", fmt.Sprintf("pkg%02d", i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		for j := range 50 {
			if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("m%02d.py", j)), []byte(fmt.Sprintf("# %d %d\n", i, j)), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := os.MkdirAll(filepath.Join(mp, "sessions"), 0o755); err != nil {
		t.Fatal(err)
	}
	session := filepath.Join(mp, "sessions", "s1.jsonl")
	if err := os.WriteFile(session, []byte(`{"role":"user"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	const unchanged = "agent/pkg07/m33.py"

	d := startDaemon(t, store, mp, state, runDir)
	st, err := ReadState(state)
	if err != nil || st.Base == "" {
		t.Fatalf("state after the seed: %+v, %v", st, err)
	}
	seed := snapshotImage(t, store, st.Base)
	lineage, ok := seed.Lineage()
	if !ok {
		t.Fatal("the seed has no lineage (no version 2 trailer)")
	}
	ino := map[string]archive.Inode{unchanged: inoOf(t, seed, unchanged), "sessions/s1.jsonl": inoOf(t, seed, "sessions/s1.jsonl")}
	mountIno := map[string]uint64{unchanged: stIno(t, filepath.Join(mp, unchanged))}

	check := func(id string, gen int) *archive.Reader {
		t.Helper()
		r := snapshotImage(t, store, id)
		if l, _ := r.Lineage(); l != lineage {
			t.Errorf("snapshot %s: lineage %x, want the seed's %x", id, l, lineage)
		}
		if g := r.Generation(); g != gen {
			t.Errorf("snapshot %s: generation %d, want %d (each snapshot extends the one before)", id, g, gen)
		}
		for p, want := range ino {
			if got := inoOf(t, r, p); got != want {
				t.Errorf("snapshot %s: %s is inode %d, was %d", id, p, got, want)
			}
		}
		m, err := (func() (uploader.Manifest, error) {
			s, _ := uploader.NewLocal(store)
			return uploader.NewCatalog(s, uploader.CatalogOptions{}).Manifest(t.Context(), id)
		})()
		if err != nil {
			t.Fatal(err)
		}
		if m.NewBytes > 64<<10 {
			t.Errorf("snapshot %s: a one-line change took a %d-byte segment", id, m.NewBytes)
		}
		return r
	}

	appendLine(t, session, `{"role":"assistant","n":1}`)
	s1 := requestSnapshot(t, state)
	check(s1.ID, 1)
	if st, _ := ReadState(state); st.LastPublished != s1.ID || st.LastNumbersOf != st.Base {
		t.Errorf("state after an extended snapshot: last %s numbered as %q, base %s", st.LastPublished, st.LastNumbersOf, st.Base)
	}
	mountIno["sessions/s1.jsonl"] = stIno(t, session)
	appendLine(t, session, `{"role":"assistant","n":2}`)
	if err := os.WriteFile(filepath.Join(mp, "sessions", "s2.jsonl"), []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	s2 := requestSnapshot(t, state)
	r2 := check(s2.ID, 2)
	ino["sessions/s2.jsonl"] = inoOf(t, r2, "sessions/s2.jsonl")

	// A clean stop rebases onto the last snapshot; the next boot mounts it
	// and extends it. Numbers hold through the mount.
	if err := d.stop(t); err != nil {
		t.Fatal(err)
	}
	d = startDaemon(t, store, mp, state, runDir)
	for p, want := range mountIno {
		if got := stIno(t, filepath.Join(mp, p)); got != want {
			t.Errorf("after a restart on a new base, %s has st_ino %d, was %d", p, got, want)
		}
	}
	if got := stIno(t, filepath.Join(mp, "sessions", "s2.jsonl")); got != uint64(ino["sessions/s2.jsonl"]) {
		t.Errorf("after a restart, a file born in the last session has st_ino %d, want its number in the snapshot (%d)", got, ino["sessions/s2.jsonl"])
	}
	appendLine(t, session, `{"role":"assistant","n":3}`)
	s3 := requestSnapshot(t, state)
	check(s3.ID, 3)

	// A restart that keeps the upper layer: the mount goes away with a
	// change unpublished, as in a crash. The next start publishes it by
	// extending the last published snapshot, which state.json says keeps
	// the lower layer's numbers (the base is still the one before s3).
	appendLine(t, session, `{"role":"assistant","n":4}`)
	s4 := requestSnapshot(t, state)
	check(s4.ID, 4)
	appendLine(t, session, `{"role":"assistant","n":5}`)
	if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	// The daemon sees its mount go and stops by itself.
	select {
	case <-d.done:
	case <-time.After(2 * time.Minute):
		t.Fatalf("the daemon did not stop when its mount went away; logs:\n%s", d.logs)
	}
	if ExitCode(d.err) != exitUnsynced {
		t.Fatalf("the daemon whose mount went away with a change: %v (exit %d), want exit %d", d.err, ExitCode(d.err), exitUnsynced)
	}
	st, _ = ReadState(state)
	if !st.Unpublished || st.LastPublished != s4.ID || st.LastNumbersOf != st.Base || st.Base == s4.ID {
		t.Fatalf("state after the mount went away: %+v", st)
	}
	d = startDaemon(t, store, mp, state, runDir)
	rec := waitStatus(t, d, state, "the recovered change published", func(s statusReport) bool { return s.Snapshots >= 1 && !s.Unpublished })
	r5 := check(rec.LastPublished, 5)
	if b, err := iofs.ReadFile(r5.FS(), "sessions/s1.jsonl"); err != nil || !strings.Contains(string(b), `"n":5`) {
		t.Errorf("the recovered snapshot's session file: %q, %v", b, err)
	}
	appendLine(t, session, `{"role":"assistant","n":6}`)
	s6 := requestSnapshot(t, state)
	check(s6.ID, 6)
	if err := d.stop(t); err != nil {
		t.Fatal(err)
	}
}
