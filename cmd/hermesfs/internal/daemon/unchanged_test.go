package daemon

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// needSQLite skips without the sqlite3 CLI, or fails under
// HERMESFS_TEST_STRICT.
func needSQLite(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("sqlite3"); err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") != "" {
			t.Fatalf("sqlite3: %v (HERMESFS_TEST_STRICT)", err)
		}
		t.Skipf("no sqlite3: %v", err)
	}
}

func sqlite3(t *testing.T, db, sql string) string {
	t.Helper()
	out, err := exec.Command("sqlite3", db, sql).CombinedOutput()
	if err != nil {
		t.Fatalf("sqlite3 %s %q: %v\n%s", db, sql, err, out)
	}
	return strings.TrimSpace(string(out))
}

// A session that only queries a WAL database in the lower layer (SQLite
// creates and removes its -wal and -shm, which moves the generation)
// publishes nothing, on request or at stop; a session that changes it
// publishes as before.
func TestQuerySessionPublishesNothing(t *testing.T) {
	needFUSE(t)
	needSQLite(t)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(state, "control.sock")
	db := filepath.Join(mp, "data", "state.db")
	snapshots := func() []string {
		names, _ := filepath.Glob(filepath.Join(store, "snapshots", "*.json"))
		return names
	}

	d := startDaemon(t, store, mp, state, runDir)
	if err := os.Mkdir(filepath.Join(mp, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Larger than --copy-up-by-range-min, as a used state.db is: opened
	// read-write by a query, it stays in the lower layer (a smaller file
	// is copied up whole at that open, which counts as a change).
	sqlite3(t, db, "PRAGMA journal_mode=WAL; CREATE TABLE t(x); INSERT INTO t VALUES (1); CREATE TABLE pad(b); INSERT INTO pad VALUES (zeroblob(6000000));")
	if err := d.stop(t); err != nil {
		t.Fatalf("first stop: %v", err)
	}
	if n := len(snapshots()); n != 1 {
		t.Fatalf("%d snapshots after the first session, want 1", n)
	}
	base := strings.TrimSpace(readFileT(t, filepath.Join(store, "LATEST")))

	// A session that only reads.
	d = startDaemon(t, store, mp, state, runDir)
	if got := sqlite3(t, db, "SELECT count(*) FROM t;"); got != "1" {
		t.Fatalf("query: %q", got)
	}
	if st := daemonStatus(t, sock); !st.Unpublished {
		t.Fatalf("the query did not move the generation (no -wal made and removed?); status %+v", st)
	}
	resp, err := ControlCall(t.Context(), sock, controlRequest{Op: "snapshot"})
	if err != nil || resp.Snapshot == nil || !resp.Snapshot.Unchanged || resp.Snapshot.ID != base {
		t.Errorf("snapshot after a query: %+v %+v, %v; want unchanged, %s", resp, resp.Snapshot, err, base)
	}
	if st := daemonStatus(t, sock); st.Unpublished {
		t.Errorf("status after the unchanged snapshot still says unpublished")
	}
	sqlite3(t, db, "SELECT * FROM t;") // once more, for the final snapshot
	if err := d.stop(t); err != nil {
		t.Fatalf("stop after a query: %v", err)
	}
	if n, latest := len(snapshots()), strings.TrimSpace(readFileT(t, filepath.Join(store, "LATEST"))); n != 1 || latest != base {
		t.Errorf("after a session that only queried: %d snapshots, LATEST %s; want 1, %s", n, latest, base)
	}
	if !strings.Contains(d.logs.String(), "nothing changed but directory times") {
		t.Errorf("the debug log does not say why nothing was published:\n%s", d.logs)
	}
	if st, err := ReadState(state); err != nil || st.Unpublished || !st.CleanShutdown || st.Base != base {
		t.Errorf("state after the query session: %+v, %v", st, err)
	}

	// A session that writes.
	d = startDaemon(t, store, mp, state, runDir)
	sqlite3(t, db, "INSERT INTO t VALUES (2);")
	if err := d.stop(t); err != nil {
		t.Fatalf("stop after a change: %v", err)
	}
	if n, latest := len(snapshots()), strings.TrimSpace(readFileT(t, filepath.Join(store, "LATEST"))); n != 2 || latest == base {
		t.Errorf("after a session that wrote: %d snapshots, LATEST %s; want 2, a new one", n, latest)
	}
}

func readFileT(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
