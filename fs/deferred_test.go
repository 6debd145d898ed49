package fs

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
)

// inUpper reports whether the upper layer holds name.
func (e *env) inUpper(name string) bool {
	_, err := os.Lstat(filepath.Join(e.upper, name))
	return err == nil
}

// TestDeferredOpenOnlyReads: a read-write open of a file copied up by range
// that only reads (and fsyncs) copies nothing up and changes nothing.
func TestDeferredOpenOnlyReads(t *testing.T) {
	t.Parallel()
	lower, content := rangeLower(t, 3<<20+1234, 11)
	e := mountEnv(t, lower, rangeOpts(time.Millisecond))
	gen := e.m.Generation()
	f, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	buf := make([]byte, 4096)
	if _, err := f.ReadAt(buf, 1<<20); err != nil {
		t.Fatal(err)
	}
	if string(buf) != string(content[1<<20:1<<20+4096]) {
		t.Error("read through a read-write open differs from the lower content")
	}
	must(t, f.Sync())
	var st unix.Stat_t
	must(t, unix.Fstat(int(f.Fd()), &st))
	if st.Size != int64(len(content)) {
		t.Errorf("fstat size %d, want %d", st.Size, len(content))
	}
	must(t, f.Close())
	if e.inUpper("big.db") {
		t.Error("a read-write open that only read copied the file up")
	}
	if ps := e.m.PartialCopyUps(); len(ps) != 0 {
		t.Errorf("partial copy-ups after reads only: %+v", ps)
	}
	if files, _ := e.m.Dirty(gen); files != 0 {
		t.Errorf("%d objects changed by a read-write open that only read", files)
	}
}

// TestDeferredOpenWrites: two read-write opens; a write through one copies
// the file up by range and the other reads it, then writes through the
// other land in the same file; a truncate through a handle works too.
func TestDeferredOpenWrites(t *testing.T) {
	t.Parallel()
	lower, content := rangeLower(t, 3<<20+1234, 12)
	// No background copy: the file must still be partial when checked.
	e := mountEnv(t, lower, rangeOpts(time.Hour))
	a, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	defer a.Close()
	b, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	defer b.Close()
	if _, err := b.WriteAt([]byte("from b"), 200_000); err != nil {
		t.Fatal(err)
	}
	copy(content[200_000:], "from b")
	if !e.inUpper("big.db") || len(e.m.PartialCopyUps()) != 1 {
		t.Fatalf("the first write did not copy up by range: upper %v, partial %+v", e.inUpper("big.db"), e.m.PartialCopyUps())
	}
	got := make([]byte, 6)
	if _, err := a.ReadAt(got, 200_000); err != nil || string(got) != "from b" {
		t.Fatalf("the other open read %q, %v", got, err)
	}
	must(t, a.Sync()) // the file is in the upper layer now: a real fsync
	if _, err := a.WriteAt([]byte("from a"), 2<<20); err != nil {
		t.Fatal(err)
	}
	copy(content[2<<20:], "from a")
	checkFile(t, e.path("big.db"), content, "after writes through both opens")

	// ftruncate through a read-write open that has not written yet.
	lower2, content2 := rangeLower(t, 2<<20, 13)
	e2 := mountEnv(t, lower2, rangeOpts(time.Millisecond))
	d, err := os.OpenFile(e2.path("big.db"), os.O_RDWR, 0)
	must(t, err)
	must(t, d.Truncate(1<<20))
	if _, err := d.WriteAt([]byte("tail"), 1<<20-4); err != nil {
		t.Fatal(err)
	}
	content2 = append(content2[:1<<20-4:1<<20-4], "tail"...)
	checkFile(t, e2.path("big.db"), content2, "after ftruncate and write through a read-write open")
	must(t, d.Close())
	waitComplete(t, e2.m)
	e2.remount()
	checkFile(t, e2.path("big.db"), content2, "after remount")
}

// TestDeferredOpenUnlinkRename: a read-write open that has not written yet
// can still write the file after its name is gone, by unlink or by a rename
// over it, as on a local file system; the new file at the name is untouched.
func TestDeferredOpenUnlinkRename(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"unlink", "rename over"} {
		t.Run(how, func(t *testing.T) {
			lower, content := rangeLower(t, 2<<20+77, 14)
			e := mountEnv(t, lower, rangeOpts(time.Millisecond))
			f, err := os.OpenFile(e.path("big.db"), os.O_RDWR, 0)
			must(t, err)
			defer f.Close()
			if how == "unlink" {
				must(t, os.Remove(e.path("big.db")))
			} else {
				e.write("new.db", "replacement")
				must(t, os.Rename(e.path("new.db"), e.path("big.db")))
			}
			if _, err := f.WriteAt([]byte("still mine"), 1<<20); err != nil {
				t.Fatalf("write after %s: %v", how, err)
			}
			copy(content[1<<20:], "still mine")
			got := make([]byte, len(content))
			if k, err := f.ReadAt(got, 0); k != len(content) {
				t.Fatalf("read after %s: %d bytes, %v", how, k, err)
			}
			if string(got) != string(content) {
				t.Errorf("content through the open after %s differs", how)
			}
			must(t, f.Sync())
			if how == "unlink" {
				e.missing("big.db")
			} else if got := e.read("big.db"); got != "replacement" {
				t.Errorf("the name holds %q after the rename", got)
			}
		})
	}
}

// TestDeferredOpenSQLite: a query opens the database read-write and leaves
// it alone; a commit copies it up by range, and the database stays intact.
func TestDeferredOpenSQLite(t *testing.T) {
	t.Parallel()
	sq := needTool(t, "sqlite3")
	src := tempDir(t)
	db := filepath.Join(src, "state.db")
	script := "PRAGMA page_size=4096; PRAGMA journal_mode=WAL; CREATE TABLE m(id INTEGER PRIMARY KEY, body TEXT);" +
		"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x<2000) INSERT INTO m(body) SELECT hex(randomblob(300)) FROM c;" +
		"PRAGMA wal_checkpoint(TRUNCATE);"
	if b, err := exec.Command(sq, db, script).CombinedOutput(); err != nil {
		t.Fatalf("sqlite3: %v\n%s", err, b)
	}
	os.Remove(db + "-wal")
	os.Remove(db + "-shm")
	img := filepath.Join(tempDir(t), "lower.sqfs")
	f, err := os.Create(img)
	must(t, err)
	if _, err := archive.PackDir(t.Context(), f, src, archive.PackOptions{}); err != nil {
		t.Fatal(err)
	}
	f.Close()
	e := mountEnv(t, openLower(t, img), rangeOpts(time.Millisecond))
	run := func(sql string) string {
		t.Helper()
		b, err := exec.Command(sq, e.path("state.db"), sql).CombinedOutput()
		if err != nil {
			t.Fatalf("sqlite3 %q: %v\n%s", sql, err, b)
		}
		return strings.TrimSpace(string(b))
	}
	if got := run("SELECT count(*) FROM m WHERE id > 1900;"); got != "100" {
		t.Fatalf("query: %s", got)
	}
	if e.inUpper("state.db") || len(e.m.PartialCopyUps()) != 0 {
		t.Fatalf("a query copied state.db up: upper %v, partial %+v", e.inUpper("state.db"), e.m.PartialCopyUps())
	}
	run("INSERT INTO m(body) VALUES('one more'); PRAGMA wal_checkpoint(TRUNCATE);")
	if !e.inUpper("state.db") {
		t.Fatal("a commit and checkpoint did not copy state.db up")
	}
	if got := run("PRAGMA integrity_check; SELECT count(*) FROM m;"); got != "ok\n2001" {
		t.Fatalf("after the commit: %s", got)
	}
	waitComplete(t, e.m)
	e.remount()
	if got := run("PRAGMA integrity_check; SELECT count(*) FROM m;"); got != "ok\n2001" {
		t.Fatalf("after remount: %s", got)
	}
}
