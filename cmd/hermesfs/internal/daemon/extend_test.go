package daemon

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
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

// Compaction in the background: once the last published image passes a
// bound (here: any extent at all), the daemon compacts it and publishes a
// snapshot of the same tree and inode numbers, laid out afresh, that says
// it compacts its parent; the next snapshot extends it. A stop cancels a
// compaction in progress and does not wait for it.
func TestRunCompaction(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	if err := os.Mkdir(store, 0o700); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		d := filepath.Join(mp, "agent", fmt.Sprintf("pkg%02d", i))
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
		for j := range 30 {
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
	policy := image.CompactPolicy{Extents: 1}
	withPolicy := func(c *Config, _ *Options) { c.Compact = &policy }

	// The hook the compactions run before they publish: the test's
	// current one.
	var hookMu sync.Mutex
	var hook func(ctx context.Context)
	setHook := func(h func(ctx context.Context)) { hookMu.Lock(); hook = h; hookMu.Unlock() }
	testCompactHook = func(ctx context.Context) {
		hookMu.Lock()
		h := hook
		hookMu.Unlock()
		if h != nil {
			h(ctx)
		}
	}
	t.Cleanup(func() { testCompactHook = nil })

	// The image compacted is read before the compaction publishes: then
	// it goes (its compaction takes its place in retention).
	written, publish := make(chan struct{}), make(chan struct{})
	setHook(func(context.Context) { close(written); <-publish; setHook(nil) })
	d := startDaemonWith(t, store, mp, state, runDir, withPolicy)
	appendLine(t, session, `{"n":1}`)
	s1 := requestSnapshot(t, state)
	select {
	case <-written:
	case <-time.After(90 * time.Second):
		t.Fatalf("no compaction started; logs:\n%s", d.logs)
	}
	r1 := snapshotImage(t, store, s1.ID)
	close(publish)
	st := waitStatus(t, d, state, "the compaction published", func(s statusReport) bool {
		return s.Compaction != nil && s.Compaction.Done >= 1 && !s.Compaction.Running
	})
	c := st.Compaction.Last
	if c == nil || c.Of != s1.ID || st.LastPublished != c.ID {
		t.Fatalf("compaction %+v; last published %s; want a compaction of %s, the last published", c, st.LastPublished, s1.ID)
	}
	m := manifestOf(t, store, c.ID)
	if m.Compacts != s1.ID || m.Parent != s1.ID {
		t.Errorf("the compaction's manifest: compacts %q, parent %q; want %s", m.Compacts, m.Parent, s1.ID)
	}
	if latest := strings.TrimSpace(readFileT(t, filepath.Join(store, "LATEST"))); latest != c.ID {
		t.Errorf("LATEST %s, want the compaction %s", latest, c.ID)
	}
	rc := snapshotImage(t, store, c.ID)
	sameImages(t, rc, r1)
	if _, err := os.Stat(filepath.Join(store, "snapshots", s1.ID+".json")); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("the compacted snapshot %s is still in the store (%v); its compaction takes its place", s1.ID, err)
	}
	if rc.Generation() != 0 || rc.GarbageBytes() != 0 {
		t.Errorf("the compacted image: generation %d, garbage %d; want 0 and 0", rc.Generation(), rc.GarbageBytes())
	}
	if l1, _ := r1.Lineage(); func() bool { l, _ := rc.Lineage(); return l != l1 }() {
		t.Error("the compaction left the lineage")
	}
	if s, _ := ReadState(state); s.LastPublished != c.ID || s.LastNumbersOf != s.Base {
		t.Errorf("state after the compaction: last %s numbered as %q (base %s)", s.LastPublished, s.LastNumbersOf, s.Base)
	}

	// The next snapshot extends the compacted image (a compaction of it
	// waits for the stop, which cancels it).
	setHook(func(ctx context.Context) { <-ctx.Done() })
	appendLine(t, session, `{"n":2}`)
	s2 := requestSnapshot(t, state)
	r2 := snapshotImage(t, store, s2.ID)
	if r2.Generation() != 1 || manifestOf(t, store, s2.ID).Parent != c.ID {
		t.Errorf("the snapshot after the compaction: generation %d, parent %s; want 1 and %s", r2.Generation(), manifestOf(t, store, s2.ID).Parent, c.ID)
	}
	if err := d.stop(t); err != nil {
		t.Fatal(err)
	}

	// A stop while a compaction runs: it is cancelled, the stop does not
	// wait for it, and the final snapshot is published over the image it
	// was compacting.
	blocked := make(chan struct{})
	cancelled := make(chan struct{})
	setHook(func(ctx context.Context) {
		close(blocked)
		<-ctx.Done()
		close(cancelled)
	})
	d = startDaemonWith(t, store, mp, state, runDir, withPolicy)
	appendLine(t, session, `{"n":3}`)
	s3 := requestSnapshot(t, state)
	select {
	case <-blocked:
	case <-time.After(90 * time.Second):
		t.Fatalf("no compaction started; logs:\n%s", d.logs)
	}
	appendLine(t, session, `{"n":4}`)
	if err := d.stop(t); err != nil {
		t.Fatal(err)
	}
	select {
	case <-cancelled:
	default:
		t.Error("the stop did not cancel the compaction")
	}
	latest := strings.TrimSpace(readFileT(t, filepath.Join(store, "LATEST")))
	fm := manifestOf(t, store, latest)
	if fm.Compacts != "" || fm.Parent != s3.ID {
		t.Errorf("after the stop LATEST is %s (compacts %q, parent %s); want the final snapshot on %s", latest, fm.Compacts, fm.Parent, s3.ID)
	}
	if b, err := iofs.ReadFile(snapshotImage(t, store, latest).FS(), "sessions/s1.jsonl"); err != nil || !strings.Contains(string(b), `"n":4`) {
		t.Errorf("the final snapshot's session file: %q, %v", b, err)
	}
}

func manifestOf(t *testing.T, store, id string) uploader.Manifest {
	t.Helper()
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	m, err := uploader.NewCatalog(s, uploader.CatalogOptions{}).Manifest(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// sameImages checks that two images hold the same tree under the same
// inode numbers.
func sameImages(t *testing.T, got, want *archive.Reader) {
	t.Helper()
	desc := func(r *archive.Reader) map[string]string {
		out := map[string]string{}
		err := iofs.WalkDir(r.FS(), ".", func(p string, de iofs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			fi, err := r.FS().Lstat(p)
			if err != nil {
				return err
			}
			st := fi.Sys().(*syscall.Stat_t)
			s := fmt.Sprintf("%v ino=%d %d:%d %d", fi.Mode(), st.Ino, st.Uid, st.Gid, fi.ModTime().UnixNano())
			// A directory's size is its listing's encoded length, which
			// depends on where its children's inodes lie: a layout
			// matter, not the tree's.
			if !fi.IsDir() {
				s += fmt.Sprintf(" size=%d", fi.Size())
			}
			if fi.Mode().IsRegular() {
				b, err := iofs.ReadFile(r.FS(), p)
				if err != nil {
					return err
				}
				s += fmt.Sprintf(" %x", sha256.Sum256(b))
			}
			out[p] = s
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	g, w := desc(got), desc(want)
	for p, d := range w {
		if g[p] != d {
			t.Errorf("%s: %q, want %q", p, g[p], d)
		}
	}
	if len(g) != len(w) {
		t.Errorf("%d entries, want %d", len(g), len(w))
	}
}
