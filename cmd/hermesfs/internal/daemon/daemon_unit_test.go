package daemon

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
)

func TestEscapePath(t *testing.T) {
	seen := map[string]string{}
	for _, tc := range []struct{ in, want string }{
		{"/", "-"},
		{"/home/u/.hermes", "home-u-%2Ehermes"},
		{"/home/u-x/h", "home-u%2Dx-h"},
		{"/a b/c.d", "a%20b-c.d"},
		{"/home/u/..x", "home-u-%2E.x"},
	} {
		got := escapePath(tc.in)
		if got != tc.want {
			t.Errorf("escapePath(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if strings.Contains(got, "/") || got == "." || got == ".." {
			t.Errorf("escapePath(%q) = %q: not one safe file name", tc.in, got)
		}
		if prev, dup := seen[got]; dup {
			t.Errorf("escapePath(%q) and (%q) collide: %q", tc.in, prev, got)
		}
		seen[got] = tc.in
	}
}

func TestDefaultStateDir(t *testing.T) {
	env := map[string]string{"HOME": "/home/u"}
	get := func(k string) string { return env[k] }
	if d, _ := DefaultStateDir("/home/u/.hermes", 0, get); d != "/var/lib/hermesfs/mounts/home-u-%2Ehermes" {
		t.Errorf("root: %s", d)
	}
	if d, _ := DefaultStateDir("/home/u/.hermes", 1000, get); d != "/home/u/.local/state/hermesfs/home-u-%2Ehermes" {
		t.Errorf("user: %s", d)
	}
	env["XDG_STATE_HOME"] = "/x/state"
	if d, _ := DefaultStateDir("/home/u/.hermes", 1000, get); d != "/x/state/hermesfs/home-u-%2Ehermes" {
		t.Errorf("XDG_STATE_HOME: %s", d)
	}
	delete(env, "XDG_STATE_HOME")
	delete(env, "HOME")
	if _, err := DefaultStateDir("/m", 1000, get); err == nil {
		t.Error("no HOME: want an error")
	}
}

func TestStateDirLockAndSave(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	sd, err := openStateDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer sd.close()
	for _, sub := range []string{"upper", "cache", "pack"} {
		if fi, err := os.Stat(filepath.Join(dir, sub)); err != nil || fi.Mode().Perm() != 0o700 {
			t.Errorf("%s: %v %v", sub, fi, err)
		}
	}
	if _, err := openStateDir(dir); !errors.Is(err, errStateLocked) {
		t.Fatalf("second open: want errStateLocked, got %v", err)
	}
	want := persistedState{Mountpoint: "/m", Base: "b1", LastPublished: "p2", Unpublished: true}
	if err := sd.save(want); err != nil {
		t.Fatal(err)
	}
	got, err := sd.load()
	if err != nil {
		t.Fatal(err)
	}
	if got.Base != "b1" || got.LastPublished != "p2" || !got.Unpublished || got.Updated.IsZero() {
		t.Errorf("round trip: %+v", got)
	}
	if fi, _ := os.Stat(filepath.Join(dir, "state.json")); fi.Mode().Perm() != 0o600 {
		t.Errorf("state.json mode %v", fi.Mode())
	}
	if tmps, _ := filepath.Glob(filepath.Join(dir, ".state.json.tmp*")); len(tmps) != 0 {
		t.Errorf("temp files left: %v", tmps)
	}
	os.WriteFile(filepath.Join(dir, "state.json"), []byte("{garbage"), 0o600)
	if _, err := sd.load(); err == nil || !strings.Contains(err.Error(), "state.json") {
		t.Errorf("corrupt state.json: %v", err)
	}
	sd.close()
	sd2, err := openStateDir(dir)
	if err != nil {
		t.Fatalf("reopen after close: %v", err)
	}
	sd2.close()
}

func TestSetAsideKeepsData(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "upper")
	os.MkdirAll(dir, 0o700)
	os.WriteFile(filepath.Join(dir, "f"), []byte("keep me"), 0o600)
	to, err := setAside(dir, "discarded")
	if err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(to, "f")); err != nil || string(b) != "keep me" {
		t.Errorf("set aside lost data: %q %v", b, err)
	}
	if empty, _ := DirEmpty(dir); !empty {
		t.Error("old name still there")
	}
}

func TestSdNotify(t *testing.T) {
	for _, abstract := range []bool{false, true} {
		name := filepath.Join(t.TempDir(), "notify.sock")
		addr := name
		if abstract {
			name = "\x00hermesfs-test-" + time.Now().Format("150405.000000000")
			addr = "@" + name[1:]
		}
		c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: name, Net: "unixgram"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		env := map[string]string{"NOTIFY_SOCKET": addr}
		if err := sdNotify(func(k string) string { return env[k] }, "READY=1\nSTATUS=hi"); err != nil {
			t.Fatalf("abstract=%v: %v", abstract, err)
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 256)
		n, err := c.Read(buf)
		if err != nil || string(buf[:n]) != "READY=1\nSTATUS=hi" {
			t.Errorf("abstract=%v: got %q %v", abstract, buf[:n], err)
		}
	}
	if err := sdNotify(func(string) string { return "" }, "READY=1"); err != nil {
		t.Errorf("no NOTIFY_SOCKET must be a no-op: %v", err)
	}
	if err := sdNotify(func(string) string { return "relative" }, "READY=1"); err == nil {
		t.Error("bad NOTIFY_SOCKET: want an error")
	}
	get := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	if iv := watchdogInterval(get(map[string]string{"WATCHDOG_USEC": "2000000"}), 1); iv != time.Second {
		t.Errorf("watchdog interval %s", iv)
	}
	if iv := watchdogInterval(get(map[string]string{"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "7"}), 1); iv != 0 {
		t.Errorf("watchdog for another pid: %s", iv)
	}
}

// testHandler answers control requests the way the daemon does, from
// fixed values, to exercise the socket protocol.
type testHandler struct {
	snaps   atomic.Int32
	stopped chan struct{}
}

func (h *testHandler) status() statusReport {
	return statusReport{Mountpoint: "/m", Running: true, Base: "b1", DirtyFiles: 3, Lease: "held"}
}

func (h *testHandler) snapshot(ctx context.Context) (snapshotResult, error) {
	if h.snaps.Add(1) == 2 {
		return snapshotResult{}, withCode(exitConflict, errors.New("lease lost"))
	}
	return snapshotResult{ID: "s1"}, nil
}

func (h *testHandler) shutdown() <-chan shutdownResult {
	ch := make(chan shutdownResult, 1)
	go func() {
		<-h.stopped
		ch <- shutdownResult{FinalID: "final", Code: exitUnsynced, Error: "upload failed"}
	}()
	return ch
}

func TestControlSocket(t *testing.T) {
	// A long directory name exercises the /proc/self/fd path for sun_path.
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 120))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "control.sock")
	ctx := t.Context()
	if _, err := ControlCall(ctx, sock, controlRequest{Op: "status"}); !errors.Is(err, ErrNoDaemon) {
		t.Fatalf("no socket: want ErrNoDaemon, got %v", err)
	}
	h := &testHandler{stopped: make(chan struct{})}
	srv, err := listenControl(sock, h, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close(time.Second)
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode: %v %v", fi, err)
	}
	r, err := ControlCall(ctx, sock, controlRequest{Op: "status"})
	if err != nil || r.Status == nil || r.Status.Base != "b1" || r.Status.DirtyFiles != 3 {
		t.Fatalf("status: %+v %v", r, err)
	}
	r, err = ControlCall(ctx, sock, controlRequest{Op: "snapshot"})
	if err != nil || r.Snapshot == nil || r.Snapshot.ID != "s1" {
		t.Fatalf("snapshot: %+v %v", r, err)
	}
	_, err = ControlCall(ctx, sock, controlRequest{Op: "snapshot"})
	if exitCodeOf(err) != exitConflict || !strings.Contains(err.Error(), "lease lost") {
		t.Fatalf("failed snapshot: code %d err %v", exitCodeOf(err), err)
	}
	if _, err := ControlCall(ctx, sock, controlRequest{Op: "bogus"}); exitCodeOf(err) != exitUsage {
		t.Errorf("unknown op: %v", err)
	}

	done := make(chan controlResponse)
	go func() {
		r, _ := ControlCall(ctx, sock, controlRequest{Op: "shutdown"})
		done <- r
	}()
	time.Sleep(50 * time.Millisecond)
	srv.stopAccepting()
	if _, err := ControlCall(ctx, sock, controlRequest{Op: "status"}); err == nil {
		t.Error("status after stopAccepting: want an error")
	}
	close(h.stopped)
	select {
	case r := <-done:
		if r.Shutdown == nil || r.Shutdown.FinalID != "final" || r.Shutdown.Code != exitUnsynced {
			t.Errorf("shutdown answer: %+v", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("shutdown answer never came")
	}
}

func TestRegistry(t *testing.T) {
	dir := t.TempDir()
	if err := registerMount(dir, registryEntry{Mountpoint: "/a", StateDir: "/s/a", Socket: "/s/a/control.sock", PID: os.Getpid()}); err != nil {
		t.Fatal(err)
	}
	// A dead pid: a stale entry.
	registerMount(dir, registryEntry{Mountpoint: "/b", PID: 1 << 30})
	got, err := ListRegistry(dir)
	if err != nil || len(got) != 1 || got[0].Mountpoint != "/a" {
		t.Fatalf("list: %+v %v", got, err)
	}
	markStopped(dir, "/a", os.Getpid()+1)
	if got, _ := ListRegistry(dir); len(got) != 1 {
		t.Error("markStopped by another pid changed the entry")
	}
	markStopped(dir, "/a", os.Getpid())
	if got, _ := ListRegistry(dir); len(got) != 0 {
		t.Errorf("after markStopped, listed as running: %+v", got)
	}
	// The stopped mount's state dir is still known: status and umount
	// of it look there, not in the default state dir.
	if e, err := lookupRegistry(dir, "/a"); err != nil || e.PID != 0 || e.Stopped.IsZero() || e.StateDir != "/s/a" {
		t.Errorf("stopped entry %+v, %v", e, err)
	}
	getenv := func(k string) string {
		if k == "HERMESFS_RUNTIME_DIR" {
			return dir
		}
		return ""
	}
	for _, c := range []struct {
		mp, stateDir, wantDir, wantFrom string
	}{
		{"/a", "", "/s/a", FromRegistry},
		{"/a", "/given", "/given", FromFlag},
		{"/b", "", "", FromDefault}, // a dead entry without a state dir
	} {
		loc, err := LocateDaemon(getenv, c.mp, c.stateDir)
		if err != nil || loc.From != c.wantFrom || c.wantDir != "" && loc.StateDir != c.wantDir {
			t.Errorf("locate %s (%q): %+v, %v; want %s from %s", c.mp, c.stateDir, loc, err, c.wantDir, c.wantFrom)
		}
	}
}

func TestRedactURL(t *testing.T) {
	for in, want := range map[string]string{
		"s3://bucket/prefix?region=auto":                "s3://bucket/prefix?region=auto",
		"s3://AKIA:secret@bucket/p":                     "s3://REDACTED@bucket/p",
		"s3://b/p?endpoint=http://x&secret_key=abc&k=v": "s3://b/p?endpoint=http://x&secret_key=REDACTED&k=v",
		"file:///var/lib/hermesfs/store":                "file:///var/lib/hermesfs/store",
		"s3://b/p?access_key_id=AK&session_token=T&x=1": "s3://b/p?access_key_id=REDACTED&session_token=REDACTED&x=1",
	} {
		if got := redactURL(in); got != want {
			t.Errorf("redactURL(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestUnescapeMountinfo(t *testing.T) {
	if got := fs.UnescapeMountinfo(`/a\040b\134c`); got != `/a b\c` {
		t.Errorf("got %q", got)
	}
	if !fs.IsMountpoint("/proc") {
		t.Error("/proc is a mountpoint")
	}
	if fs.IsMountpoint(t.TempDir()) {
		t.Error("a temp dir is not a mountpoint")
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

func TestUpperHasChanges(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "upper")
	if c, err := fs.UpperHasChanges(dir); c || err != nil {
		t.Errorf("missing upper: %v %v", c, err)
	}
	os.MkdirAll(filepath.Join(dir, ".wh..wh..work", "tmp"), 0o700)
	os.WriteFile(filepath.Join(dir, ".wh..wh..ino"), []byte("map"), 0o600)
	if c, err := fs.UpperHasChanges(dir); c || err != nil {
		t.Errorf("bookkeeping only: %v %v", c, err)
	}
	for _, name := range []string{".wh.deleted", "file", ".wh..wh..opq"} {
		p := filepath.Join(dir, name)
		os.WriteFile(p, nil, 0o600)
		if c, _ := fs.UpperHasChanges(dir); !c {
			t.Errorf("%s is a change", name)
		}
		os.Remove(p)
	}
}

func TestParseOwner(t *testing.T) {
	for _, c := range []struct {
		spec     string
		uid, gid int
		bad      bool
	}{
		{spec: "root", uid: 0, gid: 0},
		{spec: "0", uid: 0, gid: 0},
		{spec: "root:0", uid: 0, gid: 0},
		{spec: "1501:1502", uid: 1501, gid: 1502},
		{spec: "1501", bad: true}, // no passwd entry: no primary group
		{spec: "", bad: true},
		{spec: ":0", bad: true},
		{spec: "0:", bad: true},
		{spec: "no-such-user-here", bad: true},
		{spec: "root:no-such-group-here", bad: true},
	} {
		o, err := ParseOwner(c.spec)
		if c.bad {
			if err == nil {
				t.Errorf("%q: accepted as %+v", c.spec, o)
			}
			continue
		}
		if err != nil || o.Uid != c.uid || o.Gid != c.gid {
			t.Errorf("%q: %+v %v, want %d:%d", c.spec, o, err, c.uid, c.gid)
		}
	}
}
