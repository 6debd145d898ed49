package fs

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The file operations Hermes Agent does, through the mount.

// atomicWrite is how Hermes saves a file: temp file in the same directory,
// write, fsync, rename over the target, fsync the directory.
func atomicWrite(path string, data []byte) error {
	f, err := os.CreateTemp(filepath.Dir(path), ".tmp_*")
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// TestAtomicReplace replaces a lower file and an upper file many times
// while a reader checks it only ever sees a complete version.
func TestAtomicReplace(t *testing.T) {
	lower, _ := packLower(t, func(dir string) {
		os.WriteFile(filepath.Join(dir, "state.json"), []byte(`{"v":"lower"}`), 0o644)
	})
	opts := Options{}
	if os.Getenv("FSDEBUG") != "" {
		opts.Debug = true
		opts.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	e := mountEnv(t, lower, opts)
	target := e.path("state.json")
	valid := func(b []byte) bool {
		return string(b) == `{"v":"lower"}` || (bytes.HasPrefix(b, []byte(`{"v":`)) && bytes.HasSuffix(b, []byte(`"}`)) && len(b) == 1032)
	}
	stop := make(chan struct{})
	var bad atomic.Value
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			b, err := os.ReadFile(target)
			if err != nil || !valid(b) {
				bad.Store(fmt.Sprintf("read %d bytes %.20q: %v", len(b), b, err))
				return
			}
		}
	}()
	for i := 0; i < 200; i++ {
		data := fmt.Sprintf(`{"v":"%06d%s"}`, i, strings.Repeat("x", 1018))
		if err := atomicWrite(target, []byte(data)); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	if b := bad.Load(); b != nil {
		t.Fatalf("reader saw a partial file: %v", b)
	}
	if ents, _ := os.ReadDir(e.mnt); len(ents) != 1 {
		t.Errorf("temp files left: %v", ents)
	}
}

// TestExclusiveCreate: O_CREAT|O_EXCL fails on names of either layer.
func TestExclusiveCreate(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	e.write("upper.txt", "u")
	for _, p := range []string{"top.txt", "upper.txt", "a", "link"} {
		_, err := os.OpenFile(e.path(p), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if !errors.Is(err, syscall.EEXIST) {
			t.Errorf("O_EXCL on %s: %v", p, err)
		}
	}
	os.Remove(e.path("top.txt"))
	f, err := os.OpenFile(e.path("top.txt"), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		t.Fatalf("O_EXCL on a deleted lower name: %v", err)
	}
	f.Close()
	if st := lstat(t, e.path("top.txt")); st.Mode&0o777 != 0o600 || st.Size != 0 {
		t.Errorf("new file mode %o size %d", st.Mode&0o777, st.Size)
	}
}

// TestLocks: flock and fcntl byte-range locks contend between processes.
func TestLocks(t *testing.T) {
	flock := needTool(t, "flock")
	py := needTool(t, "python3")
	lower, _ := packLower(t, func(dir string) {
		os.WriteFile(filepath.Join(dir, "MEMORY.md.lock"), nil, 0o644)
	})
	e := mountEnv(t, lower, Options{})
	lock := e.path("MEMORY.md.lock")

	holder := exec.Command(flock, "-x", lock, "sh", "-c", "echo held; read x")
	stdin, _ := holder.StdinPipe()
	stdout, _ := holder.StdoutPipe()
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	if l, _ := bufio.NewReader(stdout).ReadString('\n'); l != "held\n" {
		t.Fatalf("holder: %q", l)
	}
	if err := exec.Command(flock, "-n", "-x", lock, "true").Run(); err == nil {
		t.Error("second process got the flock held by the first")
	}
	stdin.Close()
	holder.Wait()
	if out, err := exec.Command(flock, "-n", "-x", lock, "true").CombinedOutput(); err != nil {
		t.Errorf("flock after release: %v %s", err, out)
	}

	// fcntl byte ranges, as SQLite uses them.
	script := `
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX, 10, 0)
print("held", flush=True)
sys.stdin.read()
`
	h := exec.Command(py, "-c", script, lock)
	hin, _ := h.StdinPipe()
	hout, _ := h.StdoutPipe()
	if err := h.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { hin.Close(); h.Wait() }()
	if l, _ := bufio.NewReader(hout).ReadString('\n'); l != "held\n" {
		t.Fatalf("fcntl holder: %q", l)
	}
	f, err := os.OpenFile(lock, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	conflict := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: 5, Len: 10}
	if err := unix.FcntlFlock(f.Fd(), unix.F_SETLK, &conflict); !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EACCES) {
		t.Errorf("overlapping range: %v, want EAGAIN", err)
	}
	free := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: 20, Len: 10}
	if err := unix.FcntlFlock(f.Fd(), unix.F_SETLK, &free); err != nil {
		t.Errorf("disjoint range: %v", err)
	}
	q := unix.Flock_t{Type: unix.F_WRLCK, Start: 0, Len: 1}
	if err := unix.FcntlFlock(f.Fd(), unix.F_GETLK, &q); err != nil || q.Type != unix.F_WRLCK || q.Pid != int32(h.Process.Pid) {
		t.Errorf("F_GETLK: %+v %v, want the holder's lock", q, err)
	}
}

// TestLogRotation: two processes append to a log (reopening it when its
// inode changes, like a watched log handler) while it is rotated twice.
// Every line arrives exactly once and whole.
func TestLogRotation(t *testing.T) {
	py := needTool(t, "python3")
	e := mountEnv(t, nil, Options{})
	logp := e.path("agent.log")
	script := `
import os, sys
path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
f = open(path, "a"); ino = os.fstat(f.fileno()).st_ino
for i in range(n):
    try:
        cur = os.stat(path).st_ino
    except FileNotFoundError:
        cur = None
    if cur != ino:
        f.close(); f = open(path, "a"); ino = os.fstat(f.fileno()).st_ino
    f.write("%s %06d %s\n" % (tag, i, "x" * 60)); f.flush()
f.close()
`
	const n = 3000
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, tag := range []string{"p1", "p2"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if out, err := exec.Command(py, "-c", script, logp, tag, fmt.Sprint(n)).CombinedOutput(); err != nil {
				errs <- fmt.Errorf("%s: %v %s", tag, err, out)
			}
		}()
	}
	for rot := 1; rot <= 2; rot++ {
		for {
			st, err := os.Stat(logp)
			if err == nil && st.Size() > 60000 {
				break
			}
			time.Sleep(time.Millisecond)
		}
		if err := os.Rename(logp+".1", logp+".2"); err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		if err := os.Rename(logp, logp+".1"); err != nil {
			t.Fatal(err)
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for _, p := range []string{logp + ".2", logp + ".1", logp} {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(strings.TrimSuffix(string(b), "\n"), "\n") {
			f := strings.Fields(line)
			if len(f) != 3 || len(f[2]) != 60 {
				t.Fatalf("torn line in %s: %q", filepath.Base(p), line)
			}
			seen[f[0]+f[1]]++
		}
	}
	for _, tag := range []string{"p1", "p2"} {
		for i := 0; i < n; i++ {
			if c := seen[fmt.Sprintf("%s%06d", tag, i)]; c != 1 {
				t.Fatalf("%s line %d seen %d times", tag, i, c)
			}
		}
	}
}

// sqliteWriters runs n concurrent sqlite3 processes, each making rows
// autocommit inserts into db, and returns when all are done.
func sqliteWriters(t *testing.T, sqlite, db string, writers, rows int) error {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := 0; w < writers; w++ {
		var sb strings.Builder
		sb.WriteString(".timeout 30000\n")
		for i := 0; i < rows; i++ {
			fmt.Fprintf(&sb, "INSERT INTO msgs(who, n, body) VALUES('w%d', %d, hex(randomblob(300)));\n", w, i)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			cmd := exec.Command(sqlite, db)
			cmd.Stdin = strings.NewReader(sb.String())
			if out, err := cmd.CombinedOutput(); err != nil || len(out) > 0 {
				errs <- fmt.Errorf("writer %d: %v: %s", w, err, out)
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func sqliteQuery(t *testing.T, sqlite, db, q string) string {
	t.Helper()
	out, err := exec.Command(sqlite, db, q).CombinedOutput()
	if err != nil {
		t.Fatalf("sqlite3 %s: %v: %s", q, err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestSQLiteWAL: two sqlite3 processes write one WAL database (which
// starts in the lower layer, so the first write copies it up, -wal and
// -shm mmap included); integrity_check passes and no row is lost.
func TestSQLiteWAL(t *testing.T) {
	sqlite := needTool(t, "sqlite3")
	lower, _ := packLower(t, func(dir string) {
		db := filepath.Join(dir, "state.db")
		out, err := exec.Command(sqlite, db, "PRAGMA journal_mode=WAL; CREATE TABLE msgs(id INTEGER PRIMARY KEY, who TEXT, n INT, body TEXT); INSERT INTO msgs(who,n,body) VALUES('lower',0,'x');").CombinedOutput()
		if err != nil {
			panic(fmt.Sprintf("%v %s", err, out))
		}
	})
	e := mountEnv(t, lower, Options{})
	db := e.path("state.db")
	if err := sqliteWriters(t, sqlite, db, 2, 300); err != nil {
		t.Fatal(err)
	}
	if got := sqliteQuery(t, sqlite, db, "PRAGMA integrity_check;"); got != "ok" {
		t.Fatalf("integrity_check: %s", got)
	}
	if got := sqliteQuery(t, sqlite, db, "SELECT count(*) FROM msgs;"); got != "601" {
		t.Fatalf("rows: %s, want 601", got)
	}
	e.remount()
	if got := sqliteQuery(t, sqlite, db, "PRAGMA integrity_check; SELECT count(*) FROM msgs;"); got != "ok\n601" {
		t.Fatalf("after remount: %s", got)
	}
}

// TestSharedMmap: a shared writable mapping is seen by another process's
// read(2), and the other way round (SQLite's -shm works this way).
func TestSharedMmap(t *testing.T) {
	py := needTool(t, "python3")
	e := mountEnv(t, nil, Options{})
	p := e.path("state.db-shm")
	if err := os.WriteFile(p, make([]byte, 32768), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	mem, err := unix.Mmap(int(f.Fd()), 0, 32768, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	copy(mem[100:], "from go")
	if err := unix.Msync(mem, unix.MS_SYNC); err != nil {
		t.Fatal(err)
	}
	script := `
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 32768)
print(m[100:107].decode(), flush=True)
m[200:209] = b"from py!!"
m.flush()
`
	out, err := exec.Command(py, "-c", script, p).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "from go" {
		t.Fatalf("other process read %q (%v)", out, err)
	}
	if got := string(mem[200:209]); got != "from py!!" {
		t.Errorf("mapping sees %q", got)
	}
	b, _ := os.ReadFile(p)
	if string(b[200:209]) != "from py!!" || string(b[100:107]) != "from go" {
		t.Errorf("read(2) sees %q %q", b[100:107], b[200:209])
	}
}

// TestMtimeAndModes: every write moves mtime (nanoseconds); chmod 0600
// and 0700 stick.
func TestMtimeAndModes(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	f, err := os.OpenFile(e.path("top.txt"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var last unix.Timespec
	for i := 0; i < 5; i++ {
		if _, err := f.WriteString("x"); err != nil {
			t.Fatal(err)
		}
		st := lstat(t, e.path("top.txt"))
		if i > 0 && !(st.Mtim.Sec > last.Sec || st.Mtim.Sec == last.Sec && st.Mtim.Nsec > last.Nsec) {
			t.Errorf("write %d: mtime %v did not move from %v", i, st.Mtim, last)
		}
		last = st.Mtim
	}
	if got := e.read("top.txt"); got != "topxxxxx" {
		t.Errorf("appended: %q", got)
	}
	for p, mode := range map[string]os.FileMode{"secret.txt": 0o600, "a": 0o700, "top.txt": 0o600} {
		if err := os.Chmod(e.path(p), mode); err != nil {
			t.Fatal(err)
		}
		if st, _ := os.Stat(e.path(p)); st.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", p, st.Mode().Perm(), mode)
		}
	}
}

// TestOpenFileSurvivesUnlinkAndRename: an open file keeps working after its
// name is removed or moved; fsync of files and directories succeeds.
func TestOpenFileSurvivesUnlinkAndRename(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	f, err := os.OpenFile(e.path("a/one.txt"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := os.Rename(e.path("a/one.txt"), e.path("moved.txt")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("ONE"), 0); err != nil {
		t.Fatal(err)
	}
	if got := e.read("moved.txt"); got != "ONE" {
		t.Errorf("moved file reads %q", got)
	}
	if err := os.Remove(e.path("moved.txt")); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("!"), 3); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := f.ReadAt(buf, 0); err != nil || string(buf) != "ONE!" {
		t.Errorf("unlinked file reads %q %v", buf, err)
	}
	if err := f.Sync(); err != nil {
		t.Errorf("fsync of an unlinked file: %v", err)
	}
	if err := f.Truncate(2); err != nil {
		t.Errorf("ftruncate of an unlinked file: %v", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil || st.Nlink != 1 || st.Size != 2 {
		// The lower pair a/one-hard.txt still names it.
		t.Errorf("fstat: nlink %d size %d %v", st.Nlink, st.Size, err)
	}
	for _, d := range []string{"", "skills/web", "a"} {
		df, err := os.Open(e.path(d))
		if err != nil {
			t.Fatal(err)
		}
		if err := df.Sync(); err != nil {
			t.Errorf("fsync dir %q: %v", d, err)
		}
		df.Close()
	}
}

// TestPassthroughMixedOpens: a read-only open served by passthrough and a
// later writable open of the same file coexist; the writer's bytes reach
// the reader.
func TestPassthroughMixedOpens(t *testing.T) {
	e := mountEnv(t, nil, Options{PassthroughMinSize: 1})
	if !e.m.Passthrough() {
		t.Skip("kernel without FUSE passthrough")
	}
	e.write("log", "first\n")
	// The writer's RELEASE reaches the daemon after close(2) returns;
	// until it does, the file counts as open.
	e.waitReleased("log")
	n := e.m.ov.root.GetChild("log").Operations().(*node)
	r, err := os.Open(e.path("log"))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	n.mu.Lock()
	pt, id := n.ptOpens, n.backingID
	n.mu.Unlock()
	if pt != 1 || id == 0 {
		t.Fatalf("read-only open: %d passthrough handles, backing id %d", pt, id)
	}
	w, err := os.OpenFile(e.path("log"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatalf("writable open while a passthrough reader is open: %v", err)
	}
	if _, err := w.WriteString("second\n"); err != nil {
		t.Fatal(err)
	}
	gen := e.m.Generation()
	if _, err := w.WriteString("third\n"); err != nil {
		t.Fatal(err)
	}
	if e.m.Generation() == gen {
		t.Error("a write through the mixed-mode handle bypassed the daemon")
	}
	w.Close()
	b := make([]byte, 100)
	k, _ := r.ReadAt(b, 0)
	if string(b[:k]) != "first\nsecond\nthird\n" {
		t.Errorf("reader sees %q", b[:k])
	}
	// And a cached reader after everything closed sees it too.
	r.Close()
	if got := e.read("log"); got != "first\nsecond\nthird\n" {
		t.Errorf("later read: %q", got)
	}
}
