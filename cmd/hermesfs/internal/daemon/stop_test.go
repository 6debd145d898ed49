package daemon

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// sqliteWriter commits one transaction at a time through the sqlite3 CLI
// (its own process, as an agent's would be) until a commit fails: acked
// are the rows whose COMMIT returned, as the CLI said after it.
type sqliteWriter struct {
	cmd    *exec.Cmd
	stderr strings.Builder
	mu     sync.Mutex
	acked  []int
	done   chan struct{} // the CLI exited (its first error, with .bail on)
}

func startSQLiteWriter(t *testing.T, db, dir string) *sqliteWriter {
	t.Helper()
	w := &sqliteWriter{done: make(chan struct{})}
	w.cmd = exec.Command("sqlite3", db)
	w.cmd.Dir = dir // never inside the mount
	w.cmd.Stderr = &w.stderr
	in, err := w.cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := w.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		w.cmd.Process.Kill()
		<-w.done
	})
	fmt.Fprint(in, ".bail on\nPRAGMA journal_mode=WAL;\nCREATE TABLE t(n INTEGER PRIMARY KEY, pad BLOB);\nSELECT 'ack 0';\n")
	acks := make(chan int)
	go func() {
		defer close(acks)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if n, ok := strings.CutPrefix(sc.Text(), "ack "); ok {
				k, _ := strconv.Atoi(n)
				acks <- k
			}
		}
	}()
	go func() {
		defer close(w.done)
		defer w.cmd.Wait()
		defer in.Close()
		for n := 0; ; n++ {
			if _, ok := <-acks; !ok {
				return
			}
			if n > 0 {
				w.mu.Lock()
				w.acked = append(w.acked, n)
				w.mu.Unlock()
			}
			if _, err := fmt.Fprintf(in, "BEGIN; INSERT INTO t VALUES(%d, randomblob(2000)); COMMIT; SELECT 'ack %d';\n", n+1, n+1); err != nil {
				return
			}
		}
	}()
	return w
}

func (w *sqliteWriter) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.acked)
}

// syncWriter writes an increasing counter at offset 0 of a file with
// pwrite + fsync until a write or fsync fails: last is the last counter
// whose fsync returned.
type syncWriter struct {
	mu   sync.Mutex
	last uint64
	err  error
	done chan struct{}
}

func startSyncWriter(t *testing.T, path string) *syncWriter {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	w := &syncWriter{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		defer f.Close()
		var buf [8]byte
		for seq := uint64(1); ; seq++ {
			binary.LittleEndian.PutUint64(buf[:], seq)
			_, err := f.WriteAt(buf[:], 0)
			if err == nil {
				err = f.Sync()
			}
			w.mu.Lock()
			if err != nil {
				w.err = err
				w.mu.Unlock()
				return
			}
			w.last = seq
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *syncWriter) progress() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.last
}

// waitFor fails the test unless cond holds within d.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestRunStopWhileWriting: a stop does not wait for the agent. While a
// SQLite writer commits transactions one after another and two writers
// pwrite + fsync (one file small enough for writable passthrough, one
// served by the daemon), the daemon is told to stop: every write after
// the final snapshot's cut fails, status still answers (stopping, and
// what it does) while the final snapshot is packed, the daemon exits 0
// long before its stop timeout although the files stay open, and the
// published snapshot holds every transaction the writer saw commit and
// every write whose fsync returned.
func TestRunStopWhileWriting(t *testing.T) {
	needFUSE(t)
	needSQLite(t)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	const stopTimeout = 40 * time.Second
	d := startDaemonWith(t, store, mp, state, runDir, func(c *Config, _ *Options) {
		c.StopTimeout = stopTimeout
		c.PassthroughWriteMax = 4 << 20
	})
	for name, size := range map[string]int{"small.bin": 1 << 20, "large.bin": 8 << 20} {
		if err := os.WriteFile(filepath.Join(mp, name), make([]byte, size), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	sq := startSQLiteWriter(t, filepath.Join(mp, "state.db"), root)
	small := startSyncWriter(t, filepath.Join(mp, "small.bin"))
	large := startSyncWriter(t, filepath.Join(mp, "large.bin"))
	waitFor(t, time.Minute, "the writers' progress", func() bool {
		return sq.count() >= 20 && small.progress() >= 50 && large.progress() >= 50
	})

	// The final snapshot's pack waits until status has been asked.
	inPack, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	testViewHook.Store(&viewHook{readDir: func(string) {
		once.Do(func() {
			close(inPack)
			<-release
		})
	}})
	t.Cleanup(func() {
		testViewHook.Store(nil)
		select {
		case <-release:
		default:
			close(release)
		}
	})
	t0 := time.Now()
	d.cancel() // SIGTERM
	select {
	case <-inPack:
	case <-d.done:
		t.Fatalf("Run returned (%v) before the final snapshot was packed", d.err)
	case <-time.After(time.Minute):
		t.Fatal("the final snapshot did not start")
	}
	// The cut is behind: every writer's next write fails.
	for what, done := range map[string]chan struct{}{"sqlite3": sq.done, "small.bin": small.done, "large.bin": large.done} {
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s: writes still succeed after the final snapshot's freeze", what)
		}
	}
	resp, err := ControlCall(t.Context(), filepath.Join(state, "control.sock"), controlRequest{Op: "status"})
	if err != nil || resp.Status == nil || !resp.Status.Running {
		t.Errorf("status while the daemon stops: %+v, %v; want it running", resp.Status, err)
	} else if b, _ := json.Marshal(resp.Status); !strings.Contains(string(b), `"stopping":"final snapshot`) {
		t.Errorf("status while the final snapshot is packed does not say so: %s", b)
	}
	close(release)
	select {
	case <-d.done:
	case <-time.After(stopTimeout / 2):
		t.Fatalf("the daemon still runs %s after the signal (stop timeout %s)", time.Since(t0).Round(time.Millisecond), stopTimeout)
	}
	took := time.Since(t0)
	if d.err != nil {
		t.Fatalf("stop: %v (exit %d), want exit 0", d.err, ExitCode(d.err))
	}
	t.Logf("stopped %s after the signal; %d transactions, %d and %d fsynced writes acknowledged; sqlite3 said: %s; the others: %v, %v",
		took.Round(time.Millisecond), sq.count(), small.progress(), large.progress(), strings.TrimSpace(sq.stderr.String()), small.err, large.err)

	// The published snapshot holds everything acknowledged.
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	img := filepath.Join(root, "restored.sqfs")
	if _, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}).Restore(t.Context(), img, uploader.RestoreOptions{Image: image.Opener(s, nil, "")}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	ar, err := archive.Open(f, fi.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for name, w := range map[string]*syncWriter{"small.bin": small, "large.bin": large} {
		b, err := iofs.ReadFile(ar.FS(), name)
		if err != nil {
			t.Fatal(err)
		}
		// The write after the last fsynced one may have returned
		// before the cut, its fsync failing after it.
		if got := binary.LittleEndian.Uint64(b); got < w.last || got > w.last+1 {
			t.Errorf("%s: the snapshot holds write %d; write %d was the last one fsynced, and no later write returned before the cut", name, got, w.last)
		}
	}
	out := filepath.Join(root, "db")
	if err := os.Mkdir(out, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"state.db", "state.db-wal"} {
		r, err := ar.FS().Open(name)
		if err != nil {
			if name == "state.db-wal" {
				continue
			}
			t.Fatal(err)
		}
		dst, err := os.Create(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		_, err = io.Copy(dst, r)
		r.Close()
		dst.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	db := filepath.Join(out, "state.db")
	if got := sqlite3(t, db, "PRAGMA integrity_check;"); strings.TrimSpace(got) != "ok" {
		t.Errorf("integrity_check of the published database: %s", got)
	}
	rows := map[int]bool{}
	for _, l := range strings.Fields(sqlite3(t, db, "SELECT n FROM t;")) {
		n, _ := strconv.Atoi(l)
		rows[n] = true
	}
	sq.mu.Lock()
	defer sq.mu.Unlock()
	for _, n := range sq.acked {
		if !rows[n] {
			t.Errorf("transaction %d committed, but the published database lacks it (%d rows)", n, len(rows))
			break
		}
	}
}

// TestRunSecondSignalAbandonsTheFinalSnapshot: a second SIGINT or SIGTERM
// while the final snapshot is under way is acknowledged and abandons it:
// exit 5 naming the signal, the upper layer and its unpublished state kept,
// nothing published; the next start publishes it.
func TestRunSecondSignalAbandonsTheFinalSnapshot(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	sigs := make(chan os.Signal, 1)
	d := startDaemonWith(t, store, mp, state, runDir, func(_ *Config, o *Options) { o.Signals = sigs })
	writeFileT(t, filepath.Join(mp, "a.txt"), "kept for the next start\n")
	inPack, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	testViewHook.Store(&viewHook{readDir: func(string) {
		once.Do(func() {
			close(inPack)
			<-release
		})
	}})
	var releaseOnce sync.Once
	letGo := func() { releaseOnce.Do(func() { close(release) }) }
	// A failure below must not leave the pack held until the stop times out.
	t.Cleanup(func() {
		testViewHook.Store(nil)
		letGo()
	})
	d.cancel() // the first signal
	select {
	case <-inPack:
	case <-time.After(time.Minute):
		t.Fatal("the final snapshot did not start")
	}
	sigs <- syscall.SIGINT
	waitFor(t, 30*time.Second, "the second signal acknowledged in the log", func() bool {
		return strings.Contains(d.logs.String(), "second signal: stopping now, without the final snapshot")
	})
	letGo()
	select {
	case <-d.done:
	case <-time.After(time.Minute):
		t.Fatal("the daemon did not stop after the second signal")
	}
	if ExitCode(d.err) != ExitUnsynced || !strings.Contains(d.err.Error(), "second signal") {
		t.Fatalf("after a second signal: %v (exit %d), want exit %d naming it", d.err, ExitCode(d.err), ExitUnsynced)
	}
	if _, err := os.Stat(filepath.Join(store, "LATEST")); err == nil {
		t.Error("a snapshot was published although the second signal abandoned it")
	}
	if st, err := ReadState(state); err != nil || !st.Unpublished {
		t.Errorf("state.json after the abandoned stop: %+v, %v; want unpublished", st, err)
	}
	checkFile(t, filepath.Join(state, "upper", "a.txt"), "kept for the next start\n")
	testViewHook.Store(nil)

	d2 := startDaemon(t, store, mp, state, runDir)
	checkFile(t, filepath.Join(mp, "a.txt"), "kept for the next start\n")
	if err := d2.stop(t); err != nil {
		t.Fatalf("the next start's stop: %v", err)
	}
	if _, err := os.Stat(filepath.Join(store, "LATEST")); err != nil {
		t.Errorf("the next start published nothing: %v", err)
	}
}
