package daemon

import (
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// panicFile is a file of the frozen view whose reads panic, as a bug in
// the overlay's view would, on the packer's reading goroutine.
type panicFile struct{ iofs.File }

func (panicFile) Read([]byte) (int, error) { panic("injected: the view's read is broken") }

// A panic in a snapshot fails that snapshot and nothing else: the
// requested snapshot reports it, the mount goes on serving reads and
// writes, the stop exits 5 with the upper layer kept, and the next start
// is ready and serving although its recovery publish panics too; once the
// bug is gone, everything is published.
func TestSnapshotPanicContained(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run"), filepath.Join(root, "state")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	sock := filepath.Join(state, "control.sock")
	t.Cleanup(func() { testViewHook.Store(nil) })

	d1 := startDaemon(t, store, mp, state, runDir)
	writeFileT(t, filepath.Join(mp, "a.txt"), "written before the panic\n")
	writeFileT(t, filepath.Join(mp, "boom.txt"), "the packer panics reading this\n")
	testViewHook.Store(&viewHook{open: func(name string, f iofs.File) iofs.File {
		if name == "boom.txt" {
			return panicFile{f}
		}
		return f
	}})

	resp, err := ControlCall(t.Context(), sock, controlRequest{Op: "snapshot"})
	if err == nil || !strings.Contains(resp.Error, "panic: injected") || resp.Code != ExitFailure {
		t.Fatalf("snapshot with a panicking view: %+v, %v; want its error to name the panic", resp, err)
	}
	// The mount goes on.
	checkFile(t, filepath.Join(mp, "a.txt"), "written before the panic\n")
	writeFileT(t, filepath.Join(mp, "c.txt"), "written after the panic\n")
	checkFile(t, filepath.Join(mp, "c.txt"), "written after the panic\n")
	if st := daemonStatus(t, sock); !strings.Contains(st.LastError, "panic: injected") || !st.Unpublished {
		t.Errorf("status after the panic: last error %q, unpublished %v", st.LastError, st.Unpublished)
	}
	logs := d1.logs.String()
	if !strings.Contains(logs, `level=ERROR msg="snapshot failed on a panic`) || !strings.Contains(logs, "panicFile.Read") {
		t.Errorf("the log lacks the panic's error line with its stack:\n%s", logs)
	}

	// The final snapshot panics too: exit 5, everything kept locally.
	err = d1.stop(t)
	if ExitCode(err) != ExitUnsynced || !strings.Contains(err.Error(), "panic") {
		t.Fatalf("stop with a panicking view: %v (exit %d), want exit %d naming the panic", err, ExitCode(err), ExitUnsynced)
	}
	for _, name := range []string{"a.txt", "boom.txt", "c.txt"} {
		if _, err := os.Stat(filepath.Join(state, "upper", name)); err != nil {
			t.Errorf("upper layer after the failed stop: %v", err)
		}
	}
	if st, err := ReadState(state); err != nil || !st.Unpublished {
		t.Errorf("state.json after the failed stop: %+v, %v; want unpublished", st, err)
	}
	if _, err := os.Stat(filepath.Join(store, "LATEST")); err == nil {
		t.Error("a snapshot reached the store although every one panicked")
	}

	// The next start: its recovery publish panics (while listing the
	// tree, on the snapshot's own goroutine); ready and serving all the
	// same, and the failure is reported.
	testViewHook.Store(&viewHook{readDir: func(string) { panic("injected: the view's listing is broken") }})
	d2 := startDaemon(t, store, mp, state, runDir)
	checkFile(t, filepath.Join(mp, "boom.txt"), "the packer panics reading this\n")
	checkFile(t, filepath.Join(mp, "c.txt"), "written after the panic\n")
	writeFileT(t, filepath.Join(mp, "d.txt"), "written after the restart\n")
	deadline := time.Now().Add(time.Minute)
	for st := daemonStatus(t, sock); !strings.Contains(st.LastError, "listing is broken"); st = daemonStatus(t, sock) {
		if time.Now().After(deadline) {
			t.Fatalf("no failed recovery publish reported; status last error %q; logs:\n%s", st.LastError, d2.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
	checkFile(t, filepath.Join(mp, "d.txt"), "written after the restart\n")

	// The bug fixed: all of it goes to the store.
	testViewHook.Store(nil)
	resp, err = ControlCall(t.Context(), sock, controlRequest{Op: "snapshot"})
	if err != nil || resp.Error != "" || resp.Snapshot == nil || resp.Snapshot.ID == "" {
		t.Fatalf("snapshot once the view works: %+v, %v", resp, err)
	}
	if err := d2.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
	for name, want := range map[string]string{
		"a.txt": "written before the panic\n", "boom.txt": "the packer panics reading this\n",
		"c.txt": "written after the panic\n", "d.txt": "written after the restart\n",
	} {
		if got := newestFile(t, store, name); got != want {
			t.Errorf("%s in the newest snapshot: %q, want %q", name, got, want)
		}
	}
}

func writeFileT(t *testing.T, p, content string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func checkFile(t *testing.T, p, want string) {
	t.Helper()
	if got, err := os.ReadFile(p); err != nil || string(got) != want {
		t.Fatalf("%s: %q, %v; want %q", p, got, err, want)
	}
}

// daemonStatus asks the daemon at sock for its status.
func daemonStatus(t *testing.T, sock string) statusReport {
	t.Helper()
	resp, err := ControlCall(t.Context(), sock, controlRequest{Op: "status"})
	if err != nil || resp.Status == nil {
		t.Fatalf("status: %+v, %v", resp, err)
	}
	return *resp.Status
}

// newestFile reads name from the newest snapshot of the local store dir.
func newestFile(t *testing.T, store, name string) string {
	t.Helper()
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(tempDir(t), "newest.sqfs")
	if _, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}).Restore(t.Context(), dst, uploader.RestoreOptions{Image: image.Opener(s, nil, "")}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	ar, err := archive.Open(f, fi.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := iofs.ReadFile(ar.FS(), name)
	if err != nil {
		t.Fatalf("%s in the newest snapshot: %v", name, err)
	}
	return string(b)
}
