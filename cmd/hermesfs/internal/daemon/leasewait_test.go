package daemon

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// The wait for the writer lease at boot (leasewait.go), through Run with
// real mounts. Nothing here asserts how long anything took: only the order
// of events (shown read-only before the lease is ours, writable after, the
// write published) under deadlines that only fail a hung test.

// notifyLog collects what the daemon sends to systemd (NOTIFY_SOCKET).
type notifyLog struct {
	mu   sync.Mutex
	msgs []string
}

// listenNotify listens on a datagram socket and returns its log and the
// socket's address (in a directory of its own: dir may be too long a path
// for a socket).
func listenNotify(t *testing.T, dir string) (*notifyLog, string) {
	t.Helper()
	short, err := os.MkdirTemp("", "sd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(short) })
	addr := filepath.Join(short, "notify.sock")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	n := &notifyLog{}
	go func() {
		buf := make([]byte, 8192)
		for {
			k, err := c.Read(buf)
			if err != nil {
				return
			}
			n.mu.Lock()
			n.msgs = append(n.msgs, string(buf[:k]))
			n.mu.Unlock()
		}
	}()
	t.Cleanup(func() { c.Close() })
	return n, addr
}

func (n *notifyLog) all() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.msgs...)
}

// withNotify makes the daemon send its notifications to addr.
func withNotify(o *Options, addr string) {
	base := o.Getenv
	o.Getenv = func(k string) string {
		if k == "NOTIFY_SOCKET" {
			return addr
		}
		return base(k)
	}
}

// foreignLease holds the writer lease of a local store as a mount on
// another machine does (a TTL far longer than any test); kill rewrites it
// as that mount's last renewal would have been written with a TTL of ttl,
// and stops: from then on the lease lapses as a killed host's does.
type foreignLease struct {
	t     *testing.T
	store *uploader.Local
	l     *uploader.Lease
}

func holdForeignLease(t *testing.T, storeDir string, m uploader.Machine) *foreignLease {
	t.Helper()
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	c := uploader.NewCatalog(s, uploader.CatalogOptions{Host: m.Hostname + "-1a2b3c4d", Machine: m})
	l, err := c.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "hermesfs mount /home/agent/.hermes",
		StateDir: "/var/lib/hermesfs/mounts/home-agent-%2Ehermes", TTL: time.Hour, Heartbeat: -1})
	if err != nil {
		t.Fatal(err)
	}
	return &foreignLease{t: t, store: s, l: l}
}

func (f *foreignLease) kill(ttl time.Duration) {
	f.t.Helper()
	ctx := f.t.Context()
	c := uploader.NewCatalog(f.store, uploader.CatalogOptions{Host: "tester"})
	rec, etag, err := c.ReadLease(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	if rec.Token != f.l.Record().Token {
		f.t.Fatalf("the lease was taken from its holder before it was killed: %+v", rec)
	}
	now := time.Now().UTC()
	rec.Renewed, rec.Expires, rec.Write = now, now.Add(ttl), "last-renewal"
	b, _ := json.Marshal(rec)
	if _, err := f.store.Put(ctx, uploader.LeaseKey, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{IfMatch: etag}); err != nil {
		f.t.Fatal(err)
	}
}

// vanished is another machine: a host that was killed and is gone.
var vanished = uploader.Machine{Hostname: "vanished-vm", ID: "00000000000000000000000000000001", BootID: "b1"}

// statusOf asks the daemon whose state dir is state for its status; ok is
// false while it does not answer (not listening yet).
func statusOf(t *testing.T, state string) (statusReport, bool) {
	t.Helper()
	resp, err := ControlCall(t.Context(), filepath.Join(state, "control.sock"), controlRequest{Op: "status"})
	if err != nil || resp.Status == nil {
		return statusReport{}, false
	}
	return *resp.Status, true
}

// waitFor polls cond until it holds, failing after a minute and a half.
func waitRunning(t *testing.T, r *running, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		select {
		case <-r.done:
			t.Fatalf("%s: Run returned (%v) first; logs:\n%s", what, r.err, r.logs)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 90s; logs:\n%s", what, r.logs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitReady waits for the ready line.
func waitReady(t *testing.T, r *running, ready <-chan struct{}) {
	t.Helper()
	select {
	case <-ready:
	case <-r.done:
		t.Fatalf("Run returned before ready: %v; logs:\n%s", r.err, r.logs)
	case <-time.After(90 * time.Second):
		t.Fatalf("no ready line within 90s; logs:\n%s", r.logs)
	}
}

func isReady(ready <-chan struct{}) bool {
	select {
	case <-ready:
		return true
	default:
		return false
	}
}

// snapshotHas reads name from snapshot id of the local store dir.
func snapshotHas(t *testing.T, store, id, name string) string {
	t.Helper()
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	return snapshotFile(t, s, id, name)
}

// snapshotFromS3 reads name from the newest snapshot of the S3 store the
// daemons of s3ViaProxy use.
func snapshotFromS3(t *testing.T, endpoint, bucket, key, secret string, ids *crypt.Identities, name string) string {
	t.Helper()
	env := map[string]string{"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1"}
	s, _, err := storeurl.Open(t.Context(), fmt.Sprintf("s3://%s/home?endpoint=%s&path_style=true", bucket, endpoint),
		storeurl.Options{Getenv: func(k string) string { return env[k] }})
	if err != nil {
		t.Fatal(err)
	}
	return snapshotFileWith(t, s, ids, "", name)
}

// snapshotFile reads name from snapshot id ("": the newest) of s.
func snapshotFile(t *testing.T, s uploader.Store, id, name string) string {
	t.Helper()
	return snapshotFileWith(t, s, nil, id, name)
}

// snapshotFileWith is snapshotFile decrypting with ids.
func snapshotFileWith(t *testing.T, s uploader.Store, ids *crypt.Identities, id, name string) string {
	t.Helper()
	dst := filepath.Join(tempDir(t), "restored.sqfs")
	if _, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker", Identities: ids}).Restore(t.Context(), dst,
		uploader.RestoreOptions{ID: id, Image: image.Opener(s, ids, "")}); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(dst)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	ar, err := archive.Open(f, fi.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	b, err := iofs.ReadFile(ar.FS(), name)
	if err != nil {
		t.Fatalf("%s in snapshot %q: %v", name, id, err)
	}
	return string(b)
}

// controlSnapshot takes a snapshot through the control socket of state.
func controlSnapshot(t *testing.T, state string) string {
	t.Helper()
	resp, err := ControlCall(t.Context(), filepath.Join(state, "control.sock"), controlRequest{Op: "snapshot"})
	if err != nil || resp.Snapshot == nil || resp.Snapshot.ID == "" {
		t.Fatalf("snapshot: %+v %v", resp, err)
	}
	return resp.Snapshot.ID
}

// seedStore publishes a home holding files through a daemon on state dir
// state, stopped cleanly.
func seedStore(t *testing.T, store, mp, state, runDir string, files map[string]string) string {
	t.Helper()
	a := startDaemon(t, store, mp, state, runDir)
	for name, content := range files {
		writeSynced(t, filepath.Join(mp, name), content)
	}
	id := controlSnapshot(t, state)
	if err := a.stop(t); err != nil {
		t.Fatalf("seeding daemon: %v", err)
	}
	return id
}

// TestRunWaitsForVanishedHostsLease: a host on another machine holds the
// writer lease and is killed (its lease lapses, nobody releases it). A new
// host's one Run does not give up: it shows the newest snapshot at once
// with every change refused (EROFS), says in its status and on the
// systemd status line what it waits for, and once the lease lapses the
// same mount (no remount: a directory opened before still works) becomes
// writable, is ready, and what is written there is published.
func TestRunWaitsForVanishedHostsLease(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	first := seedStore(t, store, mp, filepath.Join(root, "state-old"), runDir, map[string]string{"hello.txt": "from the old host\n"})
	holder := holdForeignLease(t, store, vanished)

	nl, addr := listenNotify(t, root)
	state := filepath.Join(root, "state-new")
	r, ready := launchDaemonWith(t, store, mp, state, runDir, func(c *Config, o *Options) {
		c.LeaseWait = 2 * time.Minute
		withNotify(o, addr)
	})

	var st statusReport
	waitRunning(t, r, "status says what the mount waits for and shows", func() bool {
		var ok bool
		st, ok = statusOf(t, state)
		return ok && st.Waiting != nil && st.Waiting.Showing != ""
	})
	if got, err := os.ReadFile(filepath.Join(mp, "hello.txt")); err != nil || string(got) != "from the old host\n" {
		t.Fatalf("while waiting, hello.txt: %q %v", got, err)
	}
	root0, err := os.Open(mp)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mp, "new.txt"), []byte("x"), 0o644); !errors.Is(err, syscall.EROFS) {
		t.Errorf("a write while the lease is another's: %v, want EROFS", err)
	}
	if err := os.Remove(filepath.Join(mp, "hello.txt")); !errors.Is(err, syscall.EROFS) {
		t.Errorf("a delete while the lease is another's: %v, want EROFS", err)
	}
	if isReady(ready) {
		t.Fatal("ready while another host's lease was live")
	}
	w := st.Waiting
	if w.For != "lease" || !strings.Contains(w.Holder, "on host vanished-vm (another machine") || w.Until.IsZero() ||
		!strings.Contains(w.Showing, first) || st.Lease != "waiting" || !st.Running {
		t.Errorf("status while waiting: %+v, waiting %+v", st, w)
	}
	if logs := r.logs.String(); !strings.Contains(logs, "waiting for the writer lease held by hermesfs mount /home/agent/.hermes on host vanished-vm") {
		t.Errorf("the log does not say what the mount waits for:\n%s", logs)
	}
	waitRunning(t, r, "the systemd status line says what the mount waits for", func() bool {
		for _, m := range nl.all() {
			if strings.Contains(m, "STATUS=waiting for the writer lease, held by hermesfs mount /home/agent/.hermes on host vanished-vm") &&
				strings.Contains(m, "EXTEND_TIMEOUT_USEC=") {
				return true
			}
		}
		return false
	})
	if err := holder.l.Renew(t.Context()); err != nil {
		t.Fatalf("the holder lost its lease while it still renewed it: %v", err)
	}
	for _, m := range nl.all() {
		if strings.Contains(m, "READY=1") {
			t.Fatalf("READY=1 before the lease was ours: %q", nl.all())
		}
	}

	holder.kill(2 * time.Second)
	waitReady(t, r, ready)
	waitRunning(t, r, "READY=1 once writable", func() bool {
		for _, m := range nl.all() {
			if strings.Contains(m, "READY=1") {
				return true
			}
		}
		return false
	})
	// The same mount: a directory opened while waiting still works.
	sameMount(t, root0, "hello.txt")
	writeSynced(t, filepath.Join(mp, "new.txt"), "written on the new host\n")
	id := controlSnapshot(t, state)
	if got := snapshotHas(t, store, id, "new.txt"); got != "written on the new host\n" {
		t.Errorf("new.txt in the published snapshot: %q", got)
	}
	if got := snapshotHas(t, store, id, "hello.txt"); got != "from the old host\n" {
		t.Errorf("hello.txt in the published snapshot: %q", got)
	}
	if err := r.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
}

// TestRunWaitLatestMovedWhileWaiting: the holder is alive and keeps
// publishing while a second mount waits, then stops (and releases the
// lease). The waiting mount shows the holder's newer snapshots, and once
// the lease is its own it shows the holder's last one before it takes a
// single write: never a write over a stale base.
func TestRunWaitLatestMovedWhileWaiting(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mpA, mpB, runDir := filepath.Join(root, "store"), filepath.Join(root, "home-a"), filepath.Join(root, "home-b"), filepath.Join(root, "run")
	for _, d := range []string{store, mpA, mpB} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	stateA, stateB := filepath.Join(root, "state-a"), filepath.Join(root, "state-b")
	a := startDaemon(t, store, mpA, stateA, runDir)
	writeSynced(t, filepath.Join(mpA, "notes.txt"), "v1\n")
	controlSnapshot(t, stateA)

	b, ready := launchDaemonWith(t, store, mpB, stateB, runDir, func(c *Config, o *Options) { c.LeaseWait = 2 * time.Minute })
	read := func() string { got, _ := os.ReadFile(filepath.Join(mpB, "notes.txt")); return string(got) }
	waitRunning(t, b, "the second mount shows v1 read-only", func() bool { return read() == "v1\n" })
	if err := os.WriteFile(filepath.Join(mpB, "notes.txt"), []byte("B\n"), 0o644); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("a write while A holds the lease: %v, want EROFS", err)
	}
	// A publishes again: B shows it.
	writeSynced(t, filepath.Join(mpA, "notes.txt"), "v2\n")
	controlSnapshot(t, stateA)
	waitRunning(t, b, "the second mount shows A's newer snapshot", func() bool { return read() == "v2\n" })
	if isReady(ready) {
		t.Fatal("B ready while A holds the lease")
	}
	// A writes once more and stops: its final snapshot, then its lease
	// released. B's tree is v2 until the lease is B's.
	writeSynced(t, filepath.Join(mpA, "notes.txt"), "v3\n")
	if err := a.stop(t); err != nil {
		t.Fatalf("A's stop: %v", err)
	}
	latest := localLatestID(t, store)
	waitReady(t, b, ready)
	if got := read(); got != "v3\n" {
		t.Fatalf("B ready showing notes.txt %q, want A's last snapshot (v3)", got)
	}
	writeSynced(t, filepath.Join(mpB, "notes.txt"), "v4 from B\n")
	id := controlSnapshot(t, stateB)
	s, _ := uploader.NewLocal(store)
	m, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}).Manifest(t.Context(), id)
	if err != nil || m.Parent != latest {
		t.Errorf("B's first snapshot %s has parent %q (%v), want A's last %s", id, m.Parent, err, latest)
	}
	if got := snapshotHas(t, store, id, "notes.txt"); got != "v4 from B\n" {
		t.Errorf("notes.txt in B's snapshot: %q", got)
	}
	if err := b.stop(t); err != nil {
		t.Fatalf("B's stop: %v", err)
	}
}

// TestRunWaitTakesInUnderneathOverLatest: a new host's mountpoint
// directory holds a file written there before the mount (an agent started
// first), and the holder of the lease publishes while the new host waits.
// The tree shown meanwhile takes nothing in (it is not the one to write
// on); once the lease is ours the file is taken in over the holder's last
// snapshot and published with it, instead of being set against that
// snapshot as a local change (a conflict) or left hidden.
func TestRunWaitTakesInUnderneathOverLatest(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mpA, mpB, runDir := filepath.Join(root, "store"), filepath.Join(root, "home-a"), filepath.Join(root, "home-b"), filepath.Join(root, "run")
	for _, d := range []string{store, mpA, mpB} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	writeSynced(t, filepath.Join(mpB, "under.txt"), "written before the mount\n")
	stateA, stateB := filepath.Join(root, "state-a"), filepath.Join(root, "state-b")
	a := startDaemon(t, store, mpA, stateA, runDir)
	writeSynced(t, filepath.Join(mpA, "notes.txt"), "v1\n")
	controlSnapshot(t, stateA)

	b, ready := launchDaemonWith(t, store, mpB, stateB, runDir, func(c *Config, o *Options) { c.LeaseWait = 2 * time.Minute })
	read := func(name string) string { got, _ := os.ReadFile(filepath.Join(mpB, name)); return string(got) }
	waitRunning(t, b, "the second mount shows v1 read-only", func() bool { return read("notes.txt") == "v1\n" })
	if _, err := os.Lstat(filepath.Join(stateB, "upper", "under.txt")); err == nil {
		t.Error("the tree shown while waiting took the file underneath into the upper layer")
	}
	writeSynced(t, filepath.Join(mpA, "notes.txt"), "v2\n")
	if err := a.stop(t); err != nil {
		t.Fatalf("A's stop: %v", err)
	}
	latest := localLatestID(t, store)
	waitReady(t, b, ready)
	if got := read("notes.txt"); got != "v2\n" {
		t.Errorf("B ready showing notes.txt %q, want A's last snapshot (v2)", got)
	}
	if got := read("under.txt"); got != "written before the mount\n" {
		t.Errorf("B ready showing under.txt %q, want the file written underneath", got)
	}
	id := controlSnapshot(t, stateB)
	s, _ := uploader.NewLocal(store)
	m, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}).Manifest(t.Context(), id)
	if err != nil || m.Parent != latest {
		t.Errorf("B's first snapshot %s has parent %q (%v), want A's last %s", id, m.Parent, err, latest)
	}
	if got := snapshotHas(t, store, id, "under.txt"); got != "written before the mount\n" {
		t.Errorf("under.txt in B's snapshot: %q", got)
	}
	if err := b.stop(t); err != nil {
		t.Fatalf("B's stop: %v", err)
	}
}

// sameMount checks that dir, the mount's root opened while the mount
// waited for the lease, still reads name: the mount became writable in
// place, not replaced by another. It closes dir (an open file would keep
// the unmount at stop waiting).
func sameMount(t *testing.T, dir *os.File, name string) {
	t.Helper()
	defer dir.Close()
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Errorf("%s through the mount's root opened while waiting: %v (the mount was replaced?)", name, err)
		return
	}
	unix.Close(fd)
}

// localLatestID reads LATEST of a local store.
func localLatestID(t *testing.T, store string) string {
	t.Helper()
	s, err := uploader.NewLocal(store)
	if err != nil {
		t.Fatal(err)
	}
	id, err := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}).LatestID(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// deadPID is the pid of a process that has exited.
func deadPID(t *testing.T) int {
	t.Helper()
	c := exec.Command("true")
	if err := c.Run(); err != nil {
		t.Fatal(err)
	}
	return c.Process.Pid
}

// TestRunHolderProvenGone: a live lease written during this boot of this
// machine by a mount whose state dir lock is free, or whose process is
// gone, is taken over at once: with --lease-wait 0 the mount comes up.
// With the lock held and the process alive it is refused.
func TestRunHolderProvenGone(t *testing.T) {
	needFUSE(t)
	here := uploader.LocalMachine()
	if here.BootID == "" {
		t.Skip("no kernel boot id")
	}
	for _, c := range []struct {
		name      string
		lockHeld  bool
		noState   bool
		alivePID  bool
		wantReady bool
	}{
		{name: "state dir lock free", wantReady: true},
		{name: "state dir gone, process gone", noState: true, wantReady: true},
		{name: "lock held, process alive", lockHeld: true, alivePID: true},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			root := tempDir(t)
			store, mp := filepath.Join(root, "store"), filepath.Join(root, "home")
			for _, d := range []string{store, mp} {
				if err := os.Mkdir(d, 0o700); err != nil {
					t.Fatal(err)
				}
			}
			seedStore(t, store, mp, filepath.Join(root, "state-seed"), filepath.Join(root, "run"), map[string]string{"a.txt": "a\n"})
			gone := filepath.Join(root, "state-gone")
			if err := os.Mkdir(gone, 0o700); err != nil {
				t.Fatal(err)
			}
			lf, err := os.OpenFile(filepath.Join(gone, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			defer lf.Close()
			proc := &uploader.LeaseProcess{PID: deadPID(t), PIDNamespace: pidNamespace(), Lock: fileID(lf)}
			if c.alivePID {
				proc.PID = os.Getpid()
			}
			if c.lockHeld {
				if err := syscall.Flock(int(lf.Fd()), syscall.LOCK_EX); err != nil {
					t.Fatal(err)
				}
			}
			if c.noState {
				os.RemoveAll(gone)
			}
			now := time.Now().UTC()
			rec := uploader.LeaseRecord{Holder: "hermesfs mount /elsewhere", Host: "here-0a0b0c0d", Hostname: here.Hostname,
				MachineID: here.ID, BootID: here.BootID, StateDir: gone, Process: proc, Token: "t", Generation: 7,
				Acquired: now, Renewed: now, Expires: now.Add(time.Hour), Write: "w"}
			b, _ := json.Marshal(rec)
			s, _ := uploader.NewLocal(store)
			if _, err := s.Put(t.Context(), uploader.LeaseKey, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
				t.Fatal(err)
			}
			state := filepath.Join(root, "state-new")
			if !c.wantReady {
				logs, err := runRefused(t, store, mp, state, nil)
				if ExitCode(err) != ExitConflict {
					t.Fatalf("Run: %v (exit %d), want exit %d; logs:\n%s", err, ExitCode(err), ExitConflict, logs)
				}
				return
			}
			r := startDaemonWith(t, store, mp, state, filepath.Join(root, "run"), nil) // LeaseWait 0: no waiting
			if logs := r.logs.String(); !strings.Contains(logs, "taking over the live lease of a holder that is gone") {
				t.Errorf("no word of the takeover:\n%s", logs)
			}
			if got, _ := os.ReadFile(filepath.Join(mp, "a.txt")); string(got) != "a\n" {
				t.Errorf("a.txt: %q", got)
			}
			if err := r.stop(t); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// s3ViaProxy is a daemon edit that puts the store on versitygw behind the
// fault proxy fp.
func s3ViaProxy(fp *faultproxy.Proxy, bucket, key, secret string) func(*Config, *Options) {
	return func(c *Config, o *Options) {
		base := o.Getenv
		getenv := func(k string) string {
			switch k {
			case "AWS_ACCESS_KEY_ID":
				return key
			case "AWS_SECRET_ACCESS_KEY":
				return secret
			case "AWS_REGION":
				return "us-east-1"
			}
			return base(k)
		}
		o.Getenv = getenv
		o.Store = func(*slog.Logger) (string, storeurl.Options, error) {
			return fmt.Sprintf("s3://%s/home?endpoint=%s&path_style=true", bucket, fp.URL), storeurl.Options{Getenv: getenv, UID: os.Getuid()}, nil
		}
	}
}

// TestRunStoreUnreachableAtBoot: the host boots while the store does not
// answer. Run shows what the state dir holds at once, read-only, says the
// store does not answer, and once it does, takes the lease, finds LATEST
// still its base, makes the same mount writable and publishes the local
// changes and what is written then. The state dir holds local changes a
// failed stop left (plaintext), or, after a clean stop, the encrypted
// snapshot that stop published: the identity is checked against it
// without the store.
func TestRunStoreUnreachableAtBoot(t *testing.T) {
	t.Run("local", func(t *testing.T) { testStoreUnreachableAtBoot(t, false) })
	t.Run("enc", func(t *testing.T) { testStoreUnreachableAtBoot(t, true) })
}

func testStoreUnreachableAtBoot(t *testing.T, encrypted bool) {
	needFUSE(t)
	endpoint, bucket, key, secret := s3test.Start(t)
	fp, err := faultproxy.Start(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fp.Close() })
	root := tempDir(t)
	mp, state, runDir := filepath.Join(root, "home"), filepath.Join(root, "state"), filepath.Join(root, "run")
	if err := os.Mkdir(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	viaProxy := s3ViaProxy(fp, bucket, key, secret)
	var ids *crypt.Identities
	if encrypted {
		k, keyPath := keyFile(t, root, "key.txt")
		enc := encryptWith(t, k.Recipient().String(), keyPath)
		plain := viaProxy
		viaProxy = func(c *Config, o *Options) { plain(c, o); enc(c, o) }
		var err error
		if ids, err = crypt.LoadIdentities([]string{keyPath}); err != nil {
			t.Fatal(err)
		}
	}
	a := startDaemonWith(t, "", mp, state, runDir, viaProxy)
	writeSynced(t, filepath.Join(mp, "base.txt"), "published\n")
	base := controlSnapshot(t, state)
	want := map[string]string{"base.txt": "published\n"}
	local := !encrypted
	if local {
		writeSynced(t, filepath.Join(mp, "local.txt"), "only in the state dir\n")
		want["local.txt"] = "only in the state dir\n"
		fp.SetRule(func(faultproxy.Request) faultproxy.Fault { return faultproxy.Reset })
		if err := a.stop(t); ExitCode(err) != ExitUnsynced {
			t.Fatalf("stop with the store down: %v (exit %d), want exit %d", err, ExitCode(err), ExitUnsynced)
		}
	} else {
		if err := a.stop(t); err != nil {
			t.Fatalf("clean stop: %v", err)
		}
		if st, _ := ReadState(state); !st.CleanShutdown || st.Base != base {
			t.Fatalf("state after a clean stop: %+v, want based on %s", st, base)
		}
		fp.SetRule(func(faultproxy.Request) faultproxy.Fault { return faultproxy.Reset })
	}

	nl, addr := listenNotify(t, root)
	r, ready := launchDaemonWith(t, "", mp, state, runDir, func(c *Config, o *Options) {
		viaProxy(c, o)
		c.LeaseWait = 5 * time.Minute
		withNotify(o, addr)
	})
	var st statusReport
	waitRunning(t, r, "status says the store does not answer, with the state dir shown", func() bool {
		var ok bool
		st, ok = statusOf(t, state)
		return ok && st.Waiting != nil && st.Waiting.Showing != ""
	})
	for name, want := range want {
		if got, err := os.ReadFile(filepath.Join(mp, name)); err != nil || string(got) != want {
			t.Errorf("while the store is down, %s: %q %v", name, got, err)
		}
	}
	if err := os.WriteFile(filepath.Join(mp, "more.txt"), []byte("x"), 0o644); !errors.Is(err, syscall.EROFS) {
		t.Errorf("a write before the lease is ours: %v, want EROFS", err)
	}
	if st.Waiting.For != "store" || st.Waiting.Error == "" || !strings.Contains(st.Waiting.Showing, base) ||
		strings.Contains(st.Waiting.Showing, "local changes") != local {
		t.Errorf("status while the store is down: %+v", st.Waiting)
	}
	waitRunning(t, r, "the systemd status line says the store does not answer", func() bool {
		for _, m := range nl.all() {
			if strings.Contains(m, "STATUS=waiting for the store to answer") {
				return true
			}
		}
		return false
	})
	if isReady(ready) {
		t.Fatal("ready while the store does not answer")
	}
	root0, err := os.Open(mp)
	if err != nil {
		t.Fatal(err)
	}

	fp.SetRule(nil)
	waitReady(t, r, ready)
	sameMount(t, root0, "base.txt")
	if local {
		waitRunning(t, r, "the local changes published by themselves", func() bool {
			st, ok := statusOf(t, state)
			return ok && st.LastPublished != "" && st.LastPublished != base
		})
	}
	writeSynced(t, filepath.Join(mp, "more.txt"), "written once the store answered\n")
	want["more.txt"] = "written once the store answered\n"
	last := controlSnapshot(t, state)
	if err := r.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
	for name, want := range want {
		if got := snapshotFromS3(t, endpoint, bucket, key, secret, ids, name); got != want {
			t.Errorf("%s in the store after the outage (first published after it: %s): %q", name, last, got)
		}
	}
}

// TestRunLeaseLapsesInOutage: a store outage longer than the lease's TTL
// makes the lease lapse. Status says so (lease "lapsed", the error naming
// the store), never that another host took it over; once the store is
// back, the next snapshot takes the lease again and publishes, and status
// shows the outage's error as over.
func TestRunLeaseLapsesInOutage(t *testing.T) {
	needFUSE(t)
	endpoint, bucket, key, secret := s3test.Start(t)
	fp, err := faultproxy.Start(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fp.Close() })
	root := tempDir(t)
	mp, state := filepath.Join(root, "home"), filepath.Join(root, "state")
	if err := os.Mkdir(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	viaProxy := s3ViaProxy(fp, bucket, key, secret)
	r := startDaemonWith(t, "", mp, state, filepath.Join(root, "run"), func(c *Config, o *Options) {
		viaProxy(c, o)
		c.LeaseTTL = 2 * time.Second
	})
	writeSynced(t, filepath.Join(mp, "before.txt"), "before\n")
	controlSnapshot(t, state)

	fp.SetRule(func(faultproxy.Request) faultproxy.Fault { return faultproxy.Reset })
	var seen []string
	waitRunning(t, r, "status says the lease lapsed", func() bool {
		st, ok := statusOf(t, state)
		if !ok {
			return false
		}
		seen = append(seen, st.Lease+": "+st.LastError)
		if st.Lease == "lost" || strings.Contains(st.LastError, "taken over") {
			t.Fatalf("during a store outage status says %q (lease %s): the lease lapsed, nobody took it", st.LastError, st.Lease)
		}
		return st.Lease == "lapsed" && strings.Contains(st.LastError, "lapsed") && !st.LastErrorAt.IsZero() && st.LastErrorOver.IsZero()
	})

	fp.SetRule(nil)
	writeSynced(t, filepath.Join(mp, "after.txt"), "after\n")
	id := controlSnapshot(t, state)
	st, _ := statusOf(t, state)
	if st.Lease != "held" || st.LastErrorOver.IsZero() || !strings.Contains(st.LastErrorOverBy, id) && !strings.Contains(st.LastErrorOverBy, "taken again") {
		t.Errorf("after the store came back and %s was published: lease %q, last error %q over at %v by %q", id, st.Lease, st.LastError, st.LastErrorOver, st.LastErrorOverBy)
	}
	if err := r.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
}

// TestRunNotifiesBootSteps: during a boot that seeds the store from the
// mountpoint directory, the systemd status line says so (packing, then
// uploading) before READY=1, instead of nothing until then.
func TestRunNotifiesBootSteps(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp := filepath.Join(root, "store"), filepath.Join(root, "home")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(mp, "existing.txt"), []byte("my home before hermesfs\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	nl, addr := listenNotify(t, root)
	r := startDaemonWith(t, store, mp, filepath.Join(root, "state"), filepath.Join(root, "run"), func(c *Config, o *Options) { withNotify(o, addr) })
	var msgs []string
	waitRunning(t, r, "READY=1", func() bool {
		msgs = nl.all()
		for _, m := range msgs {
			if strings.Contains(m, "READY=1") {
				return true
			}
		}
		return false
	})
	step := func(prefix string) int {
		for i, m := range msgs {
			if strings.HasPrefix(m, "STATUS="+prefix) {
				return i
			}
		}
		return -1
	}
	packing, uploading := step("seeding the store: packing "+mp), step("seeding the store: uploading the first snapshot")
	ready := -1
	for i, m := range msgs {
		if strings.Contains(m, "READY=1") {
			ready = i
			break
		}
	}
	if packing < 0 || uploading < packing || ready < uploading {
		t.Errorf("notifications %q: want the seed's packing, then its upload, then READY=1", msgs)
	}
	if err := r.stop(t); err != nil {
		t.Fatal(err)
	}
}

// TestRunStopWhileWaiting: `hermesfs umount` (the control socket's
// shutdown) of a mount waiting for the lease ends it cleanly: the answer
// says exit 0, Run returns nil, nothing stays mounted, nothing was
// published, and the state dir made for the mount (where the snapshot
// shown was opened) is gone.
func TestRunStopWhileWaiting(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, runDir := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "run")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	first := seedStore(t, store, mp, filepath.Join(root, "state-old"), runDir, map[string]string{"a.txt": "a\n"})
	holdForeignLease(t, store, vanished)
	state := filepath.Join(root, "state-new")
	r, _ := launchDaemonWith(t, store, mp, state, runDir, func(c *Config, o *Options) { c.LeaseWait = time.Hour })
	waitRunning(t, r, "the mount waits, showing the home", func() bool {
		st, ok := statusOf(t, state)
		return ok && st.Waiting != nil && st.Waiting.Showing != ""
	})
	resp, err := ControlCall(t.Context(), filepath.Join(state, "control.sock"), controlRequest{Op: "snapshot"})
	if err == nil || ExitCode(err) != ExitConflict {
		t.Errorf("a snapshot while waiting: %+v %v, want it refused", resp, err)
	}
	resp, err = ControlCall(t.Context(), filepath.Join(state, "control.sock"), controlRequest{Op: "shutdown"})
	if err != nil || resp.Shutdown == nil || resp.Shutdown.Code != ExitOK {
		t.Fatalf("shutdown while waiting: %+v %v", resp, err)
	}
	select {
	case <-r.done:
	case <-time.After(90 * time.Second):
		t.Fatal("Run did not return after the shutdown")
	}
	if r.err != nil {
		t.Errorf("Run after a shutdown while waiting: %v", r.err)
	}
	if fs.IsMountpoint(mp) {
		t.Error("still mounted")
	}
	if got := localLatestID(t, store); got != first {
		t.Errorf("LATEST %s after a stop while waiting, want %s", got, first)
	}
	if left := tree(t, state); left != nil {
		t.Errorf("the state dir made for the mount is left after a stop while waiting: %v", left)
	}
}

// TestRunWaitDiscardLocalLatestMoved: a state dir holds local changes over
// snapshot B (a crash left them); the mount waits for the lease of a live
// holder, showing those changes read-only. The holder publishes C and
// stops. With --on-conflict discard-local the mount, once the lease is its
// own, sets the local changes aside and shows C: nothing of the decision
// made while waiting survives, so it publishes nothing (C stays LATEST)
// and does not call C's tree recovered changes.
func TestRunWaitDiscardLocalLatestMoved(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mpA, mpB, runDir := filepath.Join(root, "store"), filepath.Join(root, "home-a"), filepath.Join(root, "home-b"), filepath.Join(root, "run")
	for _, d := range []string{store, mpA, mpB} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	stateA, stateB := filepath.Join(root, "state-a"), filepath.Join(root, "state-b")
	a := startDaemon(t, store, mpA, stateA, runDir)
	writeSynced(t, filepath.Join(mpA, "notes.txt"), "v1\n")
	base := controlSnapshot(t, stateA)

	// What a crash of a mount based on B leaves in its state dir.
	if err := os.MkdirAll(filepath.Join(stateB, "upper"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(stateB, "upper", "notes.txt"), []byte("local\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	st := fmt.Sprintf(`{"mountpoint": %q, "host": "crashed-5e6f7a8b", "base": %q, "unpublished": true}`, mpB, base)
	if err := os.WriteFile(filepath.Join(stateB, "state.json"), []byte(st), 0o600); err != nil {
		t.Fatal(err)
	}

	out := &readyWriter{ready: make(chan struct{})}
	b, _ := launchDaemonWith(t, store, mpB, stateB, runDir, func(c *Config, o *Options) {
		c.LeaseWait, c.OnConflict = 2*time.Minute, "discard-local"
		o.Stdout = out // its ready line, read below
	})
	read := func() string { got, _ := os.ReadFile(filepath.Join(mpB, "notes.txt")); return string(got) }
	waitRunning(t, b, "the local changes shown while waiting", func() bool {
		st, ok := statusOf(t, stateB)
		return ok && st.Waiting != nil && strings.Contains(st.Waiting.Showing, "local changes") && read() == "local\n"
	})

	writeSynced(t, filepath.Join(mpA, "notes.txt"), "v2\n")
	if err := a.stop(t); err != nil {
		t.Fatalf("A's stop: %v", err)
	}
	theirs := localLatestID(t, store)
	if theirs == base {
		t.Fatal("A's stop published nothing")
	}
	waitReady(t, b, out.ready)
	if got := read(); got != "v2\n" {
		t.Errorf("ready showing notes.txt %q, want A's last snapshot (v2)", got)
	}
	out.mu.Lock()
	line := out.buf.String()
	out.mu.Unlock()
	if strings.Contains(line, "local=") {
		t.Errorf("ready line %q: the local changes were set aside, nothing recovered is shown", line)
	}
	if err := b.stop(t); err != nil {
		t.Fatalf("B's stop: %v", err)
	}
	if got := localLatestID(t, store); got != theirs {
		t.Errorf("LATEST %s after B's mount, which changed nothing; want A's %s", got, theirs)
	}
	aside, _ := filepath.Glob(filepath.Join(stateB, "upper.discarded-*", "notes.txt"))
	if len(aside) != 1 {
		t.Fatalf("the local changes set aside: %v", aside)
	}
	if got, _ := os.ReadFile(aside[0]); string(got) != "local\n" {
		t.Errorf("set aside: notes.txt %q", got)
	}
}
