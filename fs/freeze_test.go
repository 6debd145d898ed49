package fs

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"testing/fstest"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

func TestGate(t *testing.T) {
	var g gate
	g.enter()
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := g.freeze(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("freeze with a mutation in flight: %v", err)
	}
	// A failed freeze leaves the gate open.
	g.enter()
	g.leave()
	g.leave()
	if err := g.freeze(context.Background()); err != nil {
		t.Fatal(err)
	}
	entered := make(chan struct{})
	go func() {
		g.enter()
		close(entered)
		g.leave()
	}()
	select {
	case <-entered:
		t.Fatal("a mutation passed a frozen gate")
	case <-time.After(50 * time.Millisecond):
	}
	// A second freeze waits for the first to end.
	second := make(chan error, 1)
	go func() {
		err := g.freeze(context.Background())
		if err == nil {
			g.thaw()
		}
		second <- err
	}()
	g.thaw()
	<-entered
	if err := <-second; err != nil {
		t.Fatal(err)
	}
}

// treeState records everything a snapshot must reproduce of a tree.
type treeState map[string]string

// secondsOnly makes describe drop mtime's nanoseconds (squashfs keeps
// seconds).
var secondsOnly bool

func describe(fi iofs.FileInfo, content []byte, target string) string {
	st := fi.Sys().(*syscall.Stat_t)
	d := fmt.Sprintf("mode=%v uid=%d gid=%d", fi.Mode(), st.Uid, st.Gid)
	nsec := st.Mtim.Nsec
	if secondsOnly {
		nsec = 0
	}
	switch {
	case fi.Mode().IsRegular():
		d += fmt.Sprintf(" size=%d sha=%x mtime=%d.%09d", fi.Size(), sha256.Sum256(content), st.Mtim.Sec, nsec)
	case fi.Mode()&iofs.ModeSymlink != 0:
		d += " -> " + target
	}
	return d
}

// stateOfDir reads a directory tree of the real file system.
func stateOfDir(t *testing.T, root string) treeState {
	t.Helper()
	s := treeState{}
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		var content []byte
		var target string
		if fi.Mode().IsRegular() {
			if content, err = os.ReadFile(p); err != nil {
				return err
			}
		}
		if fi.Mode()&os.ModeSymlink != 0 {
			target, _ = os.Readlink(p)
		}
		s[rel] = describe(fi, content, target)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// stateOfFS reads a tree through io/fs (a View).
func stateOfFS(t *testing.T, fsys iofs.FS) treeState {
	t.Helper()
	s := treeState{}
	err := iofs.WalkDir(fsys, ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := iofs.Lstat(fsys, p)
		if err != nil {
			return err
		}
		var content []byte
		var target string
		if fi.Mode().IsRegular() {
			if content, err = iofs.ReadFile(fsys, p); err != nil {
				return err
			}
		}
		if fi.Mode()&iofs.ModeSymlink != 0 {
			target, _ = iofs.ReadLink(fsys, p)
		}
		s[p] = describe(fi, content, target)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func diffStates(t *testing.T, what string, got, want treeState) {
	t.Helper()
	var keys []string
	for k := range want {
		keys = append(keys, k)
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	bad := 0
	for _, k := range keys {
		if got[k] != want[k] {
			if bad++; bad <= 20 {
				t.Errorf("%s: %s:\n  got  %s\n  want %s", what, k, got[k], want[k])
			}
		}
	}
}

func randBytes(n int, seed uint64) []byte {
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24)})
	b := make([]byte, n)
	r.Read(b)
	return b
}

// TestFreezeView freezes a tree with changes in both layers, then changes
// it in every way the freeze must survive, and checks the view still shows
// exactly the frozen tree.
func TestFreezeView(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	// Changes before the freeze.
	if err := os.WriteFile(e.path("big.dat"), randBytes(256<<10+123, 1), 0o644); err != nil {
		t.Fatal(err)
	}
	e.write("a/one.txt", "copied up before the freeze")
	e.write("keep.txt", "kept")
	e.write("doomed.txt", "unlinked after the freeze")
	e.write("replaced.txt", "replaced after the freeze")
	os.MkdirAll(e.path("dir/sub"), 0o755)
	e.write("dir/sub/inner.txt", "inside a renamed dir")
	os.Link(e.path("keep.txt"), e.path("dir/keep-link"))
	os.Symlink("keep.txt", e.path("sym"))
	os.Remove(e.path("top.txt"))
	os.Rename(e.path("skills/web"), e.path("skills/moved"))
	want := stateOfDir(t, e.mnt)

	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()

	// Changes after the freeze.
	f, err := os.OpenFile(e.path("big.dat"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		off := int64(rand.IntN(256 << 10))
		if _, err := f.WriteAt(bytes.Repeat([]byte{'Z'}, 5000), off); err != nil {
			t.Fatal(err)
		}
	}
	f.Truncate(100 << 10)
	f.WriteAt([]byte("tail"), 1<<20)
	f.Close()
	e.write("a/one.txt", "changed again")
	os.Remove(e.path("doomed.txt"))
	atomicWrite(e.path("replaced.txt"), []byte("new version"))
	os.Rename(e.path("dir"), e.path("dir2"))
	e.write("dir2/sub/inner.txt", "rewritten in the renamed dir")
	os.Remove(e.path("dir2/keep-link"))
	e.write("keep.txt", "k2")
	os.Chmod(e.path("keep.txt"), 0o600)
	os.Remove(e.path("secret.txt"))
	os.RemoveAll(e.path("skills"))
	e.write("new-after.txt", "not in the view")
	os.Remove(e.path("sym"))
	os.Symlink("elsewhere", e.path("sym"))

	got := stateOfFS(t, v)
	diffStates(t, "view", got, want)
	if v.Generation() >= e.m.Generation() {
		t.Errorf("view generation %d, mount %d after changes", v.Generation(), e.m.Generation())
	}
	if err := fstest.TestFS(v, "keep.txt", "dir/sub/inner.txt", "a/one.txt", "skills/moved/SKILL.md"); err != nil {
		t.Errorf("fstest: %v", err)
	}
	if err := v.Close(); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(filepath.Join(e.upper, workDirName)); len(ents) != 0 {
		t.Errorf("view left %d entries in the work directory", len(ents))
	}
	if b, err := iofs.ReadFile(v, "keep.txt"); !errors.Is(err, iofs.ErrClosed) {
		t.Errorf("read of an upper file of a closed view: %q, %v; want ErrClosed", b, err)
	}
}

// TestViewPack packs a view with archive.Pack: the archive holds the frozen
// tree, and unchanged lower files are copied as compressed blocks.
func TestViewPack(t *testing.T) {
	needFuse(t)
	src := tempDir(t)
	sampleTree(src)
	os.WriteFile(filepath.Join(src, "large.bin"), randBytes(2<<20, 7), 0o644)
	img := filepath.Join(tempDir(t), "base.sqfs")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := archive.PackDir(t.Context(), f, src, archive.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	e := mountEnv(t, openLower(t, img), Options{})
	e.write("a/one.txt", "changed")
	e.write("upper.txt", "new")
	os.Remove(e.path("top.txt"))

	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	e.write("upper.txt", "after")
	out := filepath.Join(tempDir(t), "snap.sqfs")
	of, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	res, err := archive.Pack(t.Context(), of, v, archive.PackOptions{})
	of.Close()
	if err != nil {
		t.Fatal(err)
	}
	if res.ReusedBytes < 2<<20 {
		t.Errorf("reused %d bytes of unchanged lower content, want >= %d", res.ReusedBytes, 2<<20)
	}
	// Read back with the standard tool.
	unsq := needTool(t, "unsquashfs")
	dest := filepath.Join(tempDir(t), "x")
	if b, err := exec.Command(unsq, "-no-xattrs", "-d", dest, out).CombinedOutput(); err != nil {
		t.Fatalf("unsquashfs: %v\n%s", err, b)
	}
	secondsOnly = true
	defer func() { secondsOnly = false }()
	got := stateOfDir(t, dest)
	want := stateOfDir(t, e.mnt)
	// The live tree moved on: upper.txt was rewritten after the freeze.
	want["upper.txt"] = strings.Replace(want["upper.txt"], fmt.Sprintf("%x", sha256.Sum256([]byte("after"))), fmt.Sprintf("%x", sha256.Sum256([]byte("new"))), 1)
	for _, m := range []treeState{got, want} {
		delete(m, ".")
		delete(m, "upper.txt")
	}
	diffStates(t, "unsquashfs of the packed view", got, want)
	if b, _ := os.ReadFile(filepath.Join(dest, "upper.txt")); string(b) != "new" {
		t.Errorf("upper.txt packed as %q, want the frozen \"new\"", b)
	}
	// The lower hard-link pair, copied up together, is still one inode.
	var s1, s2 unix.Stat_t
	unix.Lstat(filepath.Join(dest, "a/one.txt"), &s1)
	unix.Lstat(filepath.Join(dest, "a/one-hard.txt"), &s2)
	if s1.Ino != s2.Ino || s1.Nlink != 2 {
		t.Errorf("hard links packed as inodes %d/%d nlink %d", s1.Ino, s2.Ino, s1.Nlink)
	}
}

// TestFreezeSQLite freezes in the middle of two concurrent sqlite3 writers:
// the view's copy of the database passes integrity_check, both packed
// into an archive and copied out directly.
func TestFreezeSQLite(t *testing.T) {
	sqlite := needTool(t, "sqlite3")
	unsq := needTool(t, "unsquashfs")
	e := mountEnv(t, nil, Options{})
	db := e.path("state.db")
	if out, err := exec.Command(sqlite, db, "PRAGMA journal_mode=WAL; CREATE TABLE msgs(id INTEGER PRIMARY KEY, who TEXT, n INT, body TEXT);").CombinedOutput(); err != nil {
		t.Fatalf("%v %s", err, out)
	}
	done := make(chan error, 1)
	go func() { done <- sqliteWriters(t, sqlite, db, 2, 400) }()
	// Freeze when the load is well under way.
	for {
		st, err := os.Stat(db + "-wal")
		if err == nil && st.Size() > 200<<10 {
			break
		}
		select {
		case err := <-done:
			t.Fatalf("writers finished before the freeze: %v", err)
		case <-time.After(2 * time.Millisecond):
		}
	}
	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	t.Logf("froze after %s of WAL, stall %v", sizeOf(db+"-wal"), v.Stall())
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	// Copy the frozen files out directly.
	direct := tempDir(t)
	for _, name := range []string{"state.db", "state.db-wal", "state.db-shm"} {
		b, err := iofs.ReadFile(v, name)
		if errors.Is(err, iofs.ErrNotExist) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(direct, name), b, 0o644)
	}
	// And through an archive and unsquashfs.
	img := filepath.Join(tempDir(t), "snap.sqfs")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := archive.Pack(t.Context(), f, v, archive.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	packed := filepath.Join(tempDir(t), "x")
	if b, err := exec.Command(unsq, "-no-xattrs", "-d", packed, img).CombinedOutput(); err != nil {
		t.Fatalf("unsquashfs: %v\n%s", err, b)
	}
	var frozenRows string
	for _, dir := range []string{direct, packed} {
		got := sqliteQuery(t, sqlite, filepath.Join(dir, "state.db"), "PRAGMA integrity_check; SELECT count(*) FROM msgs;")
		lines := strings.Split(got, "\n")
		if lines[0] != "ok" {
			t.Fatalf("integrity_check of the frozen copy in %s: %s", dir, got)
		}
		if frozenRows == "" {
			frozenRows = lines[1]
		} else if lines[1] != frozenRows {
			t.Errorf("direct copy has %s rows, packed copy %s", frozenRows, lines[1])
		}
	}
	t.Logf("frozen copy holds %s of 800 rows", frozenRows)
	if got := sqliteQuery(t, sqlite, db, "PRAGMA integrity_check; SELECT count(*) FROM msgs;"); got != "ok\n800" {
		t.Errorf("live database after the load: %s", got)
	}
}

func sizeOf(p string) string {
	st, err := os.Stat(p)
	if err != nil {
		return "?"
	}
	return fmt.Sprintf("%d KiB", st.Size()>>10)
}

// TestGenerationAndDirty: every mutation moves the generation; Dirty
// counts what changed after a view's generation.
func TestGenerationAndDirty(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	g0 := e.m.Generation()
	e.read("top.txt")
	if e.m.Generation() != g0 {
		t.Errorf("a read moved the generation")
	}
	for _, change := range []func() error{
		func() error { return os.WriteFile(e.path("empty-new"), nil, 0o644) },
		func() error { return os.Mkdir(e.path("d"), 0o755) },
		func() error { return os.Symlink("x", e.path("s")) },
		func() error { return os.Rename(e.path("s"), e.path("s2")) },
		func() error { return os.Chmod(e.path("d"), 0o700) },
		func() error { return os.Remove(e.path("s2")) },
	} {
		g := e.m.Generation()
		if err := change(); err != nil {
			t.Fatal(err)
		}
		if e.m.Generation() <= g {
			t.Errorf("a change did not move the generation")
		}
	}
	g0 = e.m.Generation()
	e.write("a.txt", "12345")
	if e.m.Generation() <= g0 {
		t.Errorf("a write did not move the generation")
	}
	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	v.Close()
	if files, bytes := e.m.Dirty(v.Generation()); files != 0 || bytes != 0 {
		// (Changes before the freeze are not counted after it.)
		t.Errorf("dirty right after a freeze: %d files %d bytes", files, bytes)
	}
	e.write("b.txt", "1234567890")
	f, _ := os.OpenFile(e.path("a.txt"), os.O_WRONLY|os.O_APPEND, 0)
	f.WriteString("678")
	f.Close()
	os.Remove(e.path("top.txt"))
	files, bytes := e.m.Dirty(v.Generation())
	if files != 3 || bytes != 13 {
		t.Errorf("dirty: %d files %d bytes, want 3 files 13 bytes", files, bytes)
	}
	if files, _ := e.m.Dirty(0); files < 3 {
		t.Errorf("dirty since 0: %d files", files)
	}
}

// TestFreezeWaitsForWrites: freezes taken while writers overwrite records
// of a file in place never capture half of a write() call, and the view
// keeps the frozen records while the writers go on.
func TestFreezeWaitsForWrites(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	const rec, nrec = 4096, 256
	if err := os.WriteFile(e.path("table"), bytes.Repeat([]byte{'.'}, rec*nrec), 0o644); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	for w := 0; w < 2; w++ {
		go func() {
			defer func() { done <- struct{}{} }()
			f, err := os.OpenFile(e.path("table"), os.O_WRONLY, 0)
			if err != nil {
				t.Error(err)
				return
			}
			defer f.Close()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				slot := rand.IntN(nrec)
				f.WriteAt(bytes.Repeat([]byte{byte('a' + rand.IntN(26))}, rec), int64(slot*rec))
			}
		}()
	}
	whole := func(b []byte) error {
		if len(b) != rec*nrec {
			return fmt.Errorf("%d bytes", len(b))
		}
		for r := 0; r < len(b); r += rec {
			if bytes.Count(b[r:r+rec], b[r:r+1]) != rec {
				return fmt.Errorf("record %d torn", r/rec)
			}
		}
		return nil
	}
	for i := 0; i < 10; i++ {
		time.Sleep(5 * time.Millisecond)
		v, err := e.m.Freeze(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		first, err := iofs.ReadFile(v, "table")
		if err == nil {
			err = whole(first)
		}
		if err != nil {
			v.Close()
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
		again, err := iofs.ReadFile(v, "table")
		v.Close()
		if err != nil || !bytes.Equal(first, again) {
			t.Fatalf("view changed under the writers (%v)", err)
		}
	}
	close(stop)
	<-done
	<-done
}

// TestViewListingHoldsOnlyItsDirectory: while a view reads the listing of
// one upper directory, a change of that directory waits for it (and stays
// out of the view), while writes, creates and renames elsewhere go on.
func TestViewListingHoldsOnlyItsDirectory(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	must(t, os.Mkdir(e.path("busy"), 0o755))
	for i := range 50 {
		e.write(fmt.Sprintf("busy/f%02d", i), "x")
	}
	must(t, os.Mkdir(e.path("other"), 0o755))
	e.write("other/f", "before")
	var st unix.Stat_t
	must(t, unix.Stat(filepath.Join(e.upper, "busy"), &st))
	busy := st.Ino

	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	testHookListing = func(uino uint64) {
		if uino == busy {
			once.Do(func() { close(entered); <-release })
		}
	}
	t.Cleanup(func() { testHookListing = nil })
	releaseOnce := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseOnce)

	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	type listed struct {
		names []string
		err   error
	}
	lc := make(chan listed, 1)
	go func() {
		ents, err := iofs.ReadDir(v, "busy")
		var names []string
		for _, de := range ents {
			names = append(names, de.Name())
		}
		lc <- listed{names, err}
	}()
	select {
	case <-entered:
	case <-time.After(30 * time.Second):
		t.Fatal("the view never started listing busy/")
	}

	elsewhere := make(chan error, 1)
	go func() {
		err := os.WriteFile(e.path("other/f"), []byte("after"), 0o644)
		if err == nil {
			err = os.WriteFile(e.path("other/g"), []byte("new"), 0o644)
		}
		if err == nil {
			err = atomicWrite(e.path("other/f"), []byte("replaced"))
		}
		elsewhere <- err
	}()
	select {
	case err := <-elsewhere:
		must(t, err)
	case <-time.After(30 * time.Second):
		releaseOnce()
		t.Fatal("a write, a create or a rename in another directory waited for the view's listing of busy/")
	}

	created := make(chan error, 1)
	go func() { created <- os.WriteFile(e.path("busy/new"), []byte("new"), 0o644) }()
	select {
	case err := <-created:
		t.Fatalf("a create in busy/ finished (%v) while the view was still listing it", err)
	case <-time.After(200 * time.Millisecond):
	}
	releaseOnce()
	l := <-lc
	must(t, l.err)
	if len(l.names) != 50 || slices.Contains(l.names, "new") {
		t.Errorf("view lists busy/ as %v, want the 50 files of the freeze", l.names)
	}
	must(t, <-created)
	if got := e.read("busy/new"); got != "new" {
		t.Errorf("busy/new = %q through the mount", got)
	}
	if b, err := iofs.ReadFile(v, "other/f"); err != nil || string(b) != "before" {
		t.Errorf("view other/f = %q, %v; want the frozen %q", b, err, "before")
	}
	if _, err := iofs.Stat(v, "other/g"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("view has other/g, created after the freeze (%v)", err)
	}
}
