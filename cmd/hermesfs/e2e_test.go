package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// seedHome writes a small Hermes-like home, with a SQLite database.
func seedHome(t *testing.T, dir string) {
	t.Helper()
	writeFile(t, filepath.Join(dir, "config.yaml"), "model: test\nmemory:\n  memory_char_limit: 2200\n", 0o644)
	writeFile(t, filepath.Join(dir, ".env"), "OPENAI_API_KEY=sk-test\n", 0o600)
	writeFile(t, filepath.Join(dir, "memories", "MEMORY.md"), "likes tea\n§\nworks on hermesfs", 0o644)
	for i := range 20 {
		writeFile(t, filepath.Join(dir, "sessions", fmt.Sprintf("s%03d.json", i)), strings.Repeat(fmt.Sprintf(`{"turn":%d,"text":"hello"}`, i), 50+i*10), 0o644)
	}
	writeFile(t, filepath.Join(dir, "skills", "web", "SKILL.md"), "# web\nfetch pages\n", 0o644)
	writeFile(t, filepath.Join(dir, "logs", "old.log"), "old log\n", 0o644)
	if err := os.Symlink("sessions/s001.json", filepath.Join(dir, "last-session")); err != nil {
		t.Fatal(err)
	}
	sqlite(t, filepath.Join(dir, "state.db"), "PRAGMA journal_mode=WAL; CREATE TABLE messages(id INTEGER PRIMARY KEY, body TEXT); INSERT INTO messages(body) VALUES ('first'),('second');")
}

// mutateHome does to a mounted home what an agent does.
func mutateHome(t *testing.T, mp string) {
	t.Helper()
	writeFile(t, filepath.Join(mp, "sessions", "new.json"), `{"new":true}`, 0o644)
	if err := os.Rename(filepath.Join(mp, "sessions", "s002.json"), filepath.Join(mp, "sessions", "renamed.json")); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(mp, "logs", "old.log")); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(filepath.Join(mp, "skills", "web")); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(mp, "sessions", "s003.json"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("../sessions/new.json", filepath.Join(mp, "memories", "link")); err != nil {
		t.Fatal(err)
	}
	// Hermes' atomic rewrite: temp file, fsync, rename over.
	tmp := filepath.Join(mp, "config.yaml.tmp")
	writeFile(t, tmp, "model: other\n", 0o644)
	if err := os.Rename(tmp, filepath.Join(mp, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	old := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	if err := os.Chtimes(filepath.Join(mp, "sessions", "s004.json"), old, old); err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		sqlite(t, filepath.Join(mp, "state.db"), fmt.Sprintf("INSERT INTO messages(body) VALUES ('msg %d %s');", i, strings.Repeat("x", 200)))
	}
}

// checkMutated checks the results of mutateHome on a restored tree.
func checkMutated(t *testing.T, dir string) {
	t.Helper()
	for _, gone := range []string{"logs/old.log", "skills/web", "sessions/s002.json"} {
		if _, err := os.Lstat(filepath.Join(dir, gone)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s: deleted, but: %v", gone, err)
		}
	}
	if got := mustRead(t, filepath.Join(dir, "config.yaml")); got != "model: other\n" {
		t.Errorf("config.yaml = %q", got)
	}
	if fi, err := os.Stat(filepath.Join(dir, "sessions", "s003.json")); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("chmod lost: %v %v", fi, err)
	}
	if l, err := os.Readlink(filepath.Join(dir, "memories", "link")); err != nil || l != "../sessions/new.json" {
		t.Errorf("symlink: %q %v", l, err)
	}
	if fi, err := os.Stat(filepath.Join(dir, "sessions", "s004.json")); err != nil || fi.ModTime().Unix() != time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC).Unix() {
		t.Errorf("mtime: %v %v", fi, err)
	}
	integrityOK(t, filepath.Join(dir, "state.db"))
	if n := sqlite(t, filepath.Join(dir, "state.db"), "SELECT count(*) FROM messages;"); n != "52" {
		t.Errorf("messages: %s rows, want 52", n)
	}
}

// fullCycle: mount over an existing home, change it, SIGTERM, and mount on a
// new host: the same tree.
func fullCycle(t *testing.T, store string, fetch func(id string) string) {
	mp := filepath.Join(e2eDir(t, "home"), "hermes")
	seedHome(t, mp)
	orig := snapshotTree(t, mp)

	a := newHost(t, store)
	d := a.mount(mp)
	if !strings.HasPrefix(d.ready, "ready "+mp+" snapshot=") {
		t.Fatalf("ready line %q", d.ready)
	}
	if diff := diffTrees(orig, snapshotTree(t, mp)); diff != "" {
		t.Fatalf("the mount does not show the existing home:\n%s", diff)
	}
	mutateHome(t, mp)
	want := snapshotTree(t, mp)
	if code := d.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("SIGTERM: exit %d\n%s", code, d.stderr)
	}
	if fs.IsMountpoint(mp) {
		t.Fatal("still mounted after exit")
	}
	// The original directory under the mount was never touched.
	if diff := diffTrees(orig, snapshotTree(t, mp)); diff != "" {
		t.Fatalf("the directory under the mount changed:\n%s", diff)
	}
	st, err := daemon.ReadState(a.state)
	if err != nil || st.LastPublished == "" || st.Base != st.LastPublished || st.Unpublished || !st.CleanShutdown {
		t.Errorf("state after a clean stop (want rebased onto the final snapshot): %+v %v", st, err)
	}
	if empty, _ := daemon.DirEmpty(filepath.Join(a.state, "upper")); !empty {
		t.Error("upper layer not emptied by the rebase")
	}

	// The first host starts again from its cache (no download), clean.
	d3 := a.mount(mp)
	if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
		t.Errorf("restart on the first host:\n%s", diff)
	}
	if log := d3.stderr.String(); strings.Contains(log, "booting lazily") || !strings.Contains(log, "in_cache=true") {
		t.Errorf("restart after a clean stop did not open the snapshot from its cache:\n%s", d3.stderr)
	}
	if code := d3.stop(syscall.SIGINT); code != 0 {
		t.Fatalf("SIGINT: exit %d\n%s", code, d3.stderr)
	}

	// A new host (fresh state dir) sees exactly the tree.
	mp2 := filepath.Join(e2eDir(t, "home2"), "hermes")
	os.MkdirAll(mp2, 0o755)
	b := newHost(t, store)
	d2 := b.mount(mp2)
	if !strings.Contains(d2.ready, "snapshot="+st.LastPublished) {
		t.Errorf("new host ready line %q, want snapshot=%s", d2.ready, st.LastPublished)
	}
	if diff := diffTrees(want, snapshotTree(t, mp2)); diff != "" {
		t.Errorf("new host sees another tree:\n%s", diff)
	}
	checkMutated(t, mp2)
	if code := d2.stop(syscall.SIGTERM); code != 0 {
		t.Fatalf("second host SIGTERM: exit %d\n%s", code, d2.stderr)
	}

	// The published object is plain squashfs for the standard tools.
	out := unsquash(t, fetch(st.LastPublished))
	if diff := diffTrees(want, snapshotTree(t, out)); diff != "" {
		t.Errorf("unsquashfs of the snapshot differs:\n%s", diff)
	}
	checkMutated(t, out)

}

func TestE2ELocalFullCycle(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs")
	storeDir := e2eDir(t, "store")
	fullCycle(t, "file://"+storeDir, func(id string) string {
		return localImage(t, storeDir, id)
	})
}

func TestE2EControlSocket(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")

	r, code := h.statusJSON(mp)
	if code != 0 || !r.Running || r.Mountpoint != mp || r.Lease != "held" || r.StateDir != h.state {
		t.Fatalf("status: exit %d %+v", code, r)
	}
	writeFile(t, filepath.Join(mp, "a.txt"), strings.Repeat("a", 10000), 0o644)
	r, _ = h.statusJSON(mp)
	if r.DirtyFiles < 1 || r.DirtyBytes < 10000 || !r.Unpublished {
		t.Errorf("status after a write: dirty %d files %d bytes, unpublished %v", r.DirtyFiles, r.DirtyBytes, r.Unpublished)
	}

	code, out, errOut := h.run("snapshot", mp)
	id := strings.TrimSpace(out)
	if code != 0 || id == "" {
		t.Fatalf("snapshot: exit %d %q %s", code, out, errOut)
	}
	if got := localLatest(t, storeDir); got != id {
		t.Errorf("LATEST %q, snapshot printed %q", got, id)
	}
	// Nothing changed: nothing uploaded.
	n := len(localSnapshots(t, storeDir))
	code, out, _ = h.run("snapshot", mp)
	if code != 0 || strings.TrimSpace(out) != id+" (unchanged)" {
		t.Errorf("second snapshot: exit %d %q", code, out)
	}
	if len(localSnapshots(t, storeDir)) != n {
		t.Error("an unchanged tree was uploaded again")
	}
	r, _ = h.statusJSON(mp)
	if r.Last == nil || r.Last.ID != id || r.Last.Size == 0 || r.DirtyFiles != 0 || r.Unpublished {
		t.Errorf("status after snapshot: %+v last %+v", r, r.Last)
	}

	// A memory file over its limit is refused, and status shows it.
	os.MkdirAll(filepath.Join(mp, "memories"), 0o755)
	if err := os.WriteFile(filepath.Join(mp, "memories", "MEMORY.md"), []byte(strings.Repeat("x", 3000)), 0o644); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("MEMORY.md over the limit: %v, want EFBIG", err)
	}
	r, _ = h.statusJSON(mp)
	if len(r.Rejections) != 1 || r.Rejections[0].File != "memories/MEMORY.md" || r.Rejections[0].Reason != "limit" {
		t.Errorf("status memory rejections: %+v", r.Rejections)
	}

	// status without MOUNTPOINT lists running mounts (by the registry).
	code, out, _ = h.run("status")
	if code != 0 || !strings.Contains(out, mp) || !strings.Contains(out, id) {
		t.Errorf("status (all): exit %d\n%s", code, out)
	}

	writeFile(t, filepath.Join(mp, "b.txt"), "b", 0o644)
	code, out, errOut = h.run("umount", mp)
	final := strings.TrimSpace(out)
	if code != 0 || final == "" || final == id {
		t.Fatalf("umount: exit %d %q %s", code, out, errOut)
	}
	if c := d.wait(); c != 0 {
		t.Errorf("daemon exit %d after umount", c)
	}
	if got := localLatest(t, storeDir); got != final {
		t.Errorf("LATEST %q after umount printed %q", got, final)
	}
	code, out, _ = h.run("status", mp)
	if code != 1 || !strings.Contains(out, "not running") {
		t.Errorf("status of a stopped mount: exit %d\n%s", code, out)
	}
	if code, _, errOut := h.run("snapshot", mp); code != 1 || !strings.Contains(errOut, "no hermesfs daemon") {
		t.Errorf("snapshot without daemon: exit %d %s", code, errOut)
	}
}

func TestE2ESdNotifyAndBackground(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	sock := filepath.Join(e2eDir(t, "notify"), "n.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: sock, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	h := newHost(t, "file://"+storeDir)
	h.extraEnv = []string{"NOTIFY_SOCKET=" + sock}

	// A daemon that fails before ready: its exit code and last log lines.
	code, out, errOut := h.run("mount", "--background", mp+"/no/such/dir")
	if code != exitFailure || out != "" || !strings.Contains(errOut, "exited before it was ready") || !strings.Contains(errOut, "no such file") {
		t.Errorf("--background on a missing mountpoint: exit %d %q\n%s", code, out, errOut)
	}

	code, out, errOut = h.run("mount", "--background", mp)
	if code != 0 || !strings.HasPrefix(out, "ready "+mp) {
		t.Fatalf("mount --background: exit %d %q\n%s", code, out, errOut)
	}
	t.Cleanup(func() {
		if fs.IsMountpoint(mp) {
			h.run("umount", mp)
		}
	})
	if !fs.IsMountpoint(mp) {
		t.Fatal("--background returned but nothing is mounted")
	}
	// STATUS= lines come first, saying what the boot does.
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 4096)
	var before []string
	for {
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatalf("sd_notify: no READY=1 after %q: %v", before, err)
		}
		if strings.Contains(string(buf[:n]), "READY=1") {
			break
		}
		before = append(before, string(buf[:n]))
	}
	if len(before) == 0 || !strings.HasPrefix(before[0], "STATUS=") {
		t.Errorf("no STATUS= before READY=1: %q", before)
	}
	r, _ := h.statusJSON(mp)
	if !r.Running || r.PID <= 0 {
		t.Fatalf("status: %+v", r)
	}
	// The daemon's cwd must not be inside the mount, and it has its own session.
	if cwd, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", r.PID)); cwd != "/" {
		t.Errorf("daemon cwd %q", cwd)
	}
	if sid, _ := syscall.Getpgid(r.PID); sid != r.PID {
		t.Errorf("daemon pgid %d, pid %d: not its own session", sid, r.PID)
	}
	writeFile(t, filepath.Join(mp, "x"), "x", 0o644)
	code, out, errOut = h.run("umount", mp)
	if code != 0 || strings.TrimSpace(out) == "" {
		t.Fatalf("umount: exit %d %q %s", code, out, errOut)
	}
	for i := 0; daemon.ProcessAlive(r.PID) && i < 100; i++ {
		time.Sleep(50 * time.Millisecond)
	}
	if daemon.ProcessAlive(r.PID) || fs.IsMountpoint(mp) {
		t.Error("daemon still running or mounted after umount")
	}
	log := mustRead(t, filepath.Join(h.state, "hermesfs.log"))
	if !strings.Contains(log, "snapshot published") {
		t.Errorf("log file lacks the snapshot line:\n%s", log)
	}
	// STOPPING=1 was sent too.
	conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	var all string
	for {
		n, err := conn.Read(buf)
		if err != nil {
			break
		}
		all += string(buf[:n]) + "\n"
	}
	if !strings.Contains(all, "STOPPING=1") {
		t.Errorf("no STOPPING=1 among %q", all)
	}
}

// writer is a subprocess writing numbered, fsynced files into dir and
// printing each number once its write and fsync returned.
func startWriter(t *testing.T, dir string) (*exec.Cmd, *bufio.Scanner) {
	t.Helper()
	script := `i=0; while :; do i=$((i+1)); printf 'content %s\n' $i > "$1/f$i.tmp" && sync "$1/f$i.tmp" && mv "$1/f$i.tmp" "$1/f$i" && sync "$1" && echo $i || exit 1; done`
	cmd := exec.Command("sh", "-c", script, "sh", dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Dir = "/"
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, bufio.NewScanner(out)
}

func TestE2EKill9(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	mp := e2eDir(t, "home")
	a := newHost(t, store)
	d := a.mount(mp, "--interval", "0")
	os.Mkdir(filepath.Join(mp, "w"), 0o755)
	writeFile(t, filepath.Join(mp, "published.txt"), "in the snapshot", 0o644)
	code, out, _ := a.run("snapshot", mp)
	published := strings.TrimSpace(out)
	if code != 0 || published == "" {
		t.Fatalf("snapshot: %d %q", code, out)
	}
	publishedTree := snapshotTree(t, mp)

	w, sc := startWriter(t, filepath.Join(mp, "w"))
	last := 0
	for sc.Scan() {
		last, _ = strconv.Atoi(sc.Text())
		if last >= 100 {
			break
		}
	}
	d.cmd.Process.Kill() // kill -9 mid-writes
	d.wait()
	for sc.Scan() {
		last, _ = strconv.Atoi(sc.Text())
	}
	w.Wait()
	if last < 100 {
		t.Fatalf("writer only got to %d", last)
	}
	// The dead mount: umount detaches it.
	if !fs.IsMountpoint(mp) {
		t.Fatal("expected the dead FUSE mount to linger")
	}
	code, out, errOut := a.run("umount", mp)
	if code != 0 || !strings.Contains(out, "detached") {
		t.Fatalf("umount of a dead mount: exit %d %q %s", code, out, errOut)
	}
	code, out, _ = a.run("status", mp)
	if code != 1 || !strings.Contains(out, "unpublished") {
		t.Errorf("status after kill -9 should tell of unpublished changes: exit %d\n%s", code, out)
	}

	// A new host sees exactly the last published snapshot.
	mpB := e2eDir(t, "homeB")
	b := newHost(t, store)
	db := b.mount(mpB, "--read-only")
	if diff := diffTrees(publishedTree, snapshotTree(t, mpB)); diff != "" {
		t.Errorf("new host after kill -9 (want the last published snapshot %s):\n%s", published, diff)
	}
	if c := db.stop(syscall.SIGTERM); c != 0 {
		t.Errorf("read-only stop: %d", c)
	}

	// Restart on the same state dir: nothing lost, published right after ready.
	d2 := a.mount(mp, "--interval", "0")
	if !strings.Contains(d2.ready, "snapshot="+published+" ") || !strings.Contains(d2.ready, "local=recovered") {
		t.Errorf("ready line after a crash %q: want the base and the recovered changes it shows", d2.ready)
	}
	for i := 1; i <= last; i++ {
		if got, err := os.ReadFile(filepath.Join(mp, "w", fmt.Sprintf("f%d", i))); err != nil || string(got) != fmt.Sprintf("content %d\n", i) {
			t.Fatalf("f%d after kill -9 and restart: %q %v", i, got, err)
		}
	}
	want := snapshotTree(t, mp)
	deadline := time.Now().Add(60 * time.Second)
	for localLatest(t, storeDir) == published && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if localLatest(t, storeDir) == published {
		t.Fatalf("the recovered changes were not published after ready:\n%s", d2.stderr)
	}
	d2.stopOK(t)
	mpC := e2eDir(t, "homeC")
	c := newHost(t, store)
	dc := c.mount(mpC)
	if diff := diffTrees(want, snapshotTree(t, mpC)); diff != "" {
		t.Errorf("new host after recovery:\n%s", diff)
	}
	dc.stop(syscall.SIGTERM)
}

func TestE2ELeaseAndConflict(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	mpA, mpB := e2eDir(t, "homeA"), e2eDir(t, "homeB")
	a, b := newHost(t, store), newHost(t, store)
	da := a.mount(mpA, "--interval", "0")
	writeFile(t, filepath.Join(mpA, "a.txt"), "from A", 0o644)
	if code, _, _ := a.run("snapshot", mpA); code != 0 {
		t.Fatal("snapshot A")
	}

	// A second host told not to wait is refused while A holds the lease.
	db := b.start(mpB, "--lease-wait", "0")
	if code := db.wait(); code != exitConflict {
		t.Fatalf("second host: exit %d, want %d\n%s", code, exitConflict, db.stderr)
	}
	if msg := db.stderr.String(); !strings.Contains(msg, "read-only") {
		t.Errorf("refusal should name the holder and --read-only:\n%s", msg)
	}
	if fs.IsMountpoint(mpB) {
		t.Fatal("refused host left a mount")
	}
	// --read-only works next to the writer: EROFS on writes.
	dr := b.mount(mpB, "--read-only")
	if got := mustRead(t, filepath.Join(mpB, "a.txt")); got != "from A" {
		t.Errorf("read-only sees %q", got)
	}
	err := os.WriteFile(filepath.Join(mpB, "b.txt"), []byte("x"), 0o644)
	if !errors.Is(err, syscall.EROFS) {
		t.Errorf("write on a read-only mount: %v, want EROFS", err)
	}
	// Once A published past it, prune on B's host still keeps the
	// read-only mount's base.
	roBase := localLatest(t, storeDir)
	writeFile(t, filepath.Join(mpA, "a2.txt"), "from A again", 0o644)
	if code, _, _ := a.run("snapshot", mpA); code != 0 {
		t.Fatal("snapshot A")
	}
	if code, out, errOut := b.run("prune", "--keep", "1", "--dry-run"); code != 0 || !strings.Contains(out, roBase) ||
		!strings.Contains(out, "base of the mount at "+mpB) {
		t.Errorf("prune next to a read-only mount: %d\n%s%s", code, out, errOut)
	}
	if c := dr.stop(syscall.SIGTERM); c != 0 {
		t.Errorf("read-only stop %d", c)
	}

	// A is killed with unpublished changes; B takes over (stale lease) and
	// publishes; A's restart is refused until told what to do.
	writeFile(t, filepath.Join(mpA, "unpublished.txt"), "A's local change", 0o644)
	da.cmd.Process.Kill()
	da.wait()
	syscall.Unmount(mpA, syscall.MNT_DETACH)
	// A's lease is still live, but A ran on this machine during this boot
	// and its process is gone: B's one mount takes the lease at once.
	db2 := b.mount(mpB)
	if !strings.Contains(db2.stderr.String(), "taking over the live lease of a holder that is gone") {
		t.Errorf("B did not take the lease of the killed A at once:\n%s", db2.stderr)
	}
	writeFile(t, filepath.Join(mpB, "b.txt"), "from B", 0o644)
	if c := db2.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("B stop: %d\n%s", c, db2.stderr)
	}
	theirs := localLatest(t, storeDir)

	dA := a.start(mpA)
	if code := dA.wait(); code != exitConflict {
		t.Fatalf("A restart after B published: exit %d, want %d\n%s", code, exitConflict, dA.stderr)
	}
	msg := dA.stderr.String()
	if !strings.Contains(msg, theirs) || !strings.Contains(msg, "keep-local") || !strings.Contains(msg, "discard-local") {
		t.Errorf("conflict message should name %s and both flags:\n%s", theirs, msg)
	}
	// discard-local: B's tree, A's changes set aside, never deleted.
	dA2 := a.mount(mpA, "--on-conflict", "discard-local")
	if got := mustRead(t, filepath.Join(mpA, "b.txt")); got != "from B" {
		t.Errorf("after discard-local: b.txt %q", got)
	}
	if _, err := os.Stat(filepath.Join(mpA, "unpublished.txt")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("discarded change still visible: %v", err)
	}
	aside, _ := filepath.Glob(filepath.Join(a.state, "upper.discarded-*", "unpublished.txt"))
	if len(aside) != 1 || mustRead(t, aside[0]) != "A's local change" {
		t.Errorf("discarded changes not kept aside: %v", aside)
	}
	dA2.stop(syscall.SIGTERM)
}

func TestE2EStoreDownAtSigterm(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0", "--stop-timeout", "20s")
	writeFile(t, filepath.Join(mp, "precious.txt"), "do not lose me", 0o644)
	// The store becomes unreachable: its directory is replaced by a file.
	if err := os.Rename(storeDir, storeDir+".away"); err != nil {
		t.Fatal(err)
	}
	writeFile(t, storeDir, "not a directory", 0o644)
	if code := d.stop(syscall.SIGTERM); code != exitUnsynced {
		t.Fatalf("SIGTERM with the store down: exit %d, want %d\n%s", code, exitUnsynced, d.stderr)
	}
	if got := mustRead(t, filepath.Join(h.state, "upper", "precious.txt")); got != "do not lose me" {
		t.Fatalf("upper layer not kept: %q", got)
	}
	st, _ := daemon.ReadState(h.state)
	if !st.Unpublished {
		t.Errorf("state.json should record unpublished changes: %+v", st)
	}
	// The store is back: the next start publishes at once.
	os.Remove(storeDir)
	os.Rename(storeDir+".away", storeDir)
	d2 := h.mount(mp, "--interval", "0")
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		r, _ := h.statusJSON(mp)
		if r.Last != nil && r.Snapshots > 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	d2.stopOK(t)
	out := unsquashLatest(t, storeDir)
	if got := mustRead(t, filepath.Join(out, "precious.txt")); got != "do not lose me" {
		t.Errorf("published after the store came back: %q", got)
	}
}

func TestE2EIntervalWithSQLiteWriter(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "1s", "--keep", "100")
	db := filepath.Join(mp, "state.db")
	sqlite(t, db, "PRAGMA journal_mode=WAL; CREATE TABLE t(id INTEGER PRIMARY KEY, v TEXT);")
	stop := make(chan struct{})
	errc := make(chan error, 2)
	go func() { // SQLite writer
		for i := 0; ; i++ {
			select {
			case <-stop:
				errc <- nil
				return
			default:
			}
			sql := fmt.Sprintf("BEGIN; INSERT INTO t(v) VALUES ('%d %s'); INSERT INTO t(v) SELECT v FROM t ORDER BY id DESC LIMIT 3; COMMIT;", i, strings.Repeat("y", 500))
			if out, err := exec.Command("sqlite3", db, sql).CombinedOutput(); err != nil {
				errc <- fmt.Errorf("sqlite3: %v %s", err, out)
				return
			}
		}
	}()
	go func() { // file churn
		for i := 0; ; i++ {
			select {
			case <-stop:
				errc <- nil
				return
			default:
			}
			p := filepath.Join(mp, "churn", fmt.Sprintf("f%d", i%30))
			os.MkdirAll(filepath.Dir(p), 0o755)
			if err := os.WriteFile(p+".tmp", []byte(strings.Repeat("z", i%5000)), 0o644); err != nil {
				errc <- err
				return
			}
			if err := os.Rename(p+".tmp", p); err != nil {
				errc <- err
				return
			}
			if i%7 == 0 {
				os.Remove(filepath.Join(mp, "churn", fmt.Sprintf("f%d", (i+13)%30)))
			}
		}
	}()
	deadline := time.Now().Add(60 * time.Second)
	for len(localSnapshots(t, storeDir)) < 5 && time.Now().Before(deadline) {
		time.Sleep(200 * time.Millisecond)
	}
	close(stop)
	for range 2 {
		if err := <-errc; err != nil {
			t.Fatal(err)
		}
	}
	d.stopOK(t)
	snaps := localSnapshots(t, storeDir)
	if len(snaps) < 5 {
		t.Fatalf("only %d snapshots published:\n%s", len(snaps), d.stderr)
	}
	for _, s := range snaps {
		id := strings.TrimSuffix(filepath.Base(s), ".json")
		out := unsquash(t, localImage(t, storeDir, id))
		if _, err := os.Stat(filepath.Join(out, "state.db")); err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		integrityOK(t, filepath.Join(out, "state.db"))
	}
	t.Logf("%d snapshots, each restores to a database that passes integrity_check", len(snaps))
}

func TestE2ESigtermDuringPack(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "unsquashfs")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")
	// Enough incompressible data that a pack takes a noticeable while.
	f, err := os.Create(filepath.Join(mp, "big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	rnd, _ := os.Open("/dev/urandom")
	buf := make([]byte, 1<<20)
	for range 96 {
		rnd.Read(buf)
		f.Write(buf)
	}
	rnd.Close()
	f.Close()
	// Ask for a snapshot and SIGTERM the daemon while it packs.
	snap := make(chan string, 1)
	go func() {
		_, out, _ := h.run("snapshot", mp)
		snap <- strings.TrimSpace(out)
	}()
	deadline := time.Now().Add(30 * time.Second)
	packing := false
	for !packing && time.Now().Before(deadline) {
		r, _ := h.statusJSON(mp)
		packing = r.InProgress
	}
	if !packing {
		t.Fatal("never saw the snapshot in progress")
	}
	writeFile(t, filepath.Join(mp, "late.txt"), "written during the pack", 0o644)
	if c := d.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("SIGTERM during a pack: exit %d\n%s", c, d.stderr)
	}
	<-snap
	latest := localLatest(t, storeDir)
	out := unsquash(t, localImage(t, storeDir, latest))
	if got := mustRead(t, filepath.Join(out, "late.txt")); got != "written during the pack" {
		t.Errorf("final snapshot lacks the write made during the pack: %q", got)
	}
	if fi, err := os.Stat(filepath.Join(out, "big.bin")); err != nil || fi.Size() != 96<<20 {
		t.Errorf("big.bin in the final snapshot: %v %v", fi, err)
	}
	// Every manifest in the store names a complete image.
	manifests, _ := filepath.Glob(filepath.Join(storeDir, "snapshots", "*.json"))
	for _, m := range manifests {
		id := strings.TrimSuffix(filepath.Base(m), ".json")
		if fi, err := os.Stat(localImage(t, storeDir, id)); err != nil || fi.Size() == 0 {
			t.Errorf("snapshot %s: image %v %v", id, fi, err)
		}
	}
}

func TestE2EEntrypoint(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	script, _ := filepath.Abs("../../scripts/entrypoint.sh")
	agent := `trap 'echo agent stopping >&2; sqlite3 "$H/state.db" "INSERT INTO t VALUES (-1);"; exit 0' TERM
sqlite3 "$H/state.db" "CREATE TABLE IF NOT EXISTS t(v INTEGER);"
i=0; while :; do i=$((i+1)); sqlite3 "$H/state.db" "INSERT INTO t VALUES ($i);"; echo $i > "$H/counter"; sleep 0.05; done`
	cmd := exec.Command("sh", script, "sh", "-c", agent)
	cmd.Env = append(h.env(), "HERMESFS_BIN="+hermesfsBin(t), "HERMESFS_MOUNTPOINT="+mp, "H="+mp, "HERMESFS_MOUNT_ARGS=--interval 0")
	cmd.Dir = "/"
	stderr := &syncBuffer{}
	cmd.Stderr, cmd.Stdout = stderr, stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		if fs.IsMountpoint(mp) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
	})
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if b, err := os.ReadFile(filepath.Join(mp, "counter")); err == nil && len(b) > 0 && fs.IsMountpoint(mp) {
			if n, _ := strconv.Atoi(strings.TrimSpace(string(b))); n >= 10 {
				break
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("entrypoint exit: %v\n%s", err, stderr)
		}
	case <-time.After(90 * time.Second):
		t.Fatalf("entrypoint did not stop:\n%s", stderr)
	}
	log := stderr.String()
	if i, j := strings.Index(log, "agent stopping"), strings.Index(log, "snapshot published"); i < 0 || j < 0 || i > j {
		t.Errorf("the agent must stop before the final snapshot:\n%s", log)
	}
	if fs.IsMountpoint(mp) {
		t.Fatal("still mounted after the entrypoint exited")
	}
	out := unsquashLatest(t, storeDir)
	integrityOK(t, filepath.Join(out, "state.db"))
	if got := sqlite(t, filepath.Join(out, "state.db"), "SELECT count(*) FROM t WHERE v = -1;"); got != "1" {
		t.Errorf("the agent's last write (on SIGTERM) is not in the final snapshot: %s", got)
	}
	if n := sqlite(t, filepath.Join(out, "state.db"), "SELECT count(*) FROM t;"); n == "0" || n == "1" {
		t.Errorf("rows in the final snapshot: %s", n)
	}
}

func TestE2ESystemdUnits(t *testing.T) {
	if _, err := exec.LookPath("systemd-analyze"); err != nil {
		t.Skip("systemd-analyze is not installed (optional: the units are checked where it is)")
	}
	for _, unit := range []string{"hermesfs.service", "hermesfs-user.service"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "scripts", unit))
		if err != nil {
			t.Fatal(err)
		}
		// The binary is not installed here: point ExecStart at one that is.
		text := strings.ReplaceAll(string(b), "/usr/local/bin/hermesfs", "/bin/true")
		p := filepath.Join(t.TempDir(), unit)
		os.WriteFile(p, []byte(text), 0o644)
		out, err := exec.Command("systemd-analyze", "verify", "--man=no", p).CombinedOutput()
		if err != nil || len(strings.TrimSpace(string(out))) > 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", unit, err, out)
		}
		for _, want := range []string{"Type=notify", "TimeoutStopSec=", "KillMode=mixed", "Restart=on-failure"} {
			if !strings.Contains(text, want) {
				t.Errorf("%s lacks %s", unit, want)
			}
		}
	}
}

func TestE2ES3FullCycle(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs")
	endpoint, bucket, _, _ := s3test.Start(t) // its credentials are in the environment (TestMain)
	store := fmt.Sprintf("s3://%s/agents/test?endpoint=%s&region=%s&path_style=true", bucket, endpoint, s3test.Region)
	s, _, err := storeurl.Open(t.Context(), store, storeurl.Options{UID: os.Getuid()})
	if err != nil {
		t.Fatal(err)
	}
	fullCycle(t, store, func(id string) string {
		// Put the image together as any S3 client would: a GET of the
		// extents list, then a ranged GET of each extent.
		rc, _, err := s.Get(t.Context(), uploader.ExtentsKey(id), 0, -1)
		if err != nil {
			t.Fatalf("get the extents of %s: %v", id, err)
		}
		list, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(e2eDir(t, "dl"), id+".sqfs")
		f, err := os.Create(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		for line := range strings.Lines(string(list)) {
			var key string
			var off, n int64
			if _, err := fmt.Sscan(line, &key, &off, &n); err != nil {
				t.Fatalf("extents of %s: %q: %v", id, line, err)
			}
			rc, _, err := s.Get(t.Context(), key, off, n)
			if err != nil {
				t.Fatalf("get %s bytes %d+%d: %v", key, off, n, err)
			}
			got, err := io.Copy(f, rc)
			rc.Close()
			if err != nil || got != n {
				t.Fatalf("get %s bytes %d+%d: %d bytes, %v", key, off, n, got, err)
			}
		}
		return p
	})
}

func TestE2ELeaseTakenOver(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "before.txt"), "published", 0o644)
	if code, _, errOut := h.run("snapshot", mp); code != 0 {
		t.Fatalf("snapshot: %d %s", code, errOut)
	}
	ls := takeLeaseOver(t, h, d, mp, storeDir)
	latest := localLatest(t, storeDir)
	// The mount is still served; publishing has stopped.
	writeFile(t, filepath.Join(mp, "after.txt"), "kept locally", 0o644)
	if code, _, errOut := h.run("snapshot", mp); code != exitConflict {
		t.Errorf("snapshot after losing the lease: exit %d, want %d: %s", code, exitConflict, errOut)
	}
	if got := localLatest(t, storeDir); got != latest {
		t.Errorf("LATEST moved from %s to %s after the lease was lost", latest, got)
	}
	// The other host publishes, then goes away and releases its lease.
	// Taking the lease back now would gain us nothing (our publishes
	// conflict) and lock that host out when it restarts.
	publishTree(t, uploader.NewCatalog(ls, uploader.CatalogOptions{Host: "elsewhere"}), makeTree(t, 99))
	if err := ls.Delete(t.Context(), uploader.LeaseKey); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut := h.run("snapshot", mp); code != exitConflict {
		t.Errorf("snapshot after another host published: exit %d, want %d: %s", code, exitConflict, errOut)
	}
	rec, _, err := uploader.NewCatalog(ls, uploader.CatalogOptions{}).ReadLease(t.Context())
	if err == nil && !rec.Released {
		t.Errorf("the lease was kept after another host published: %+v", rec)
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if code := d.stop(syscall.SIGTERM); code != exitConflict {
		t.Errorf("stop after losing the lease: exit %d, want %d", code, exitConflict)
	}
	if got := mustRead(t, filepath.Join(h.state, "upper", "after.txt")); got != "kept locally" {
		t.Errorf("local change not kept: %q", got)
	}
	if st, _ := daemon.ReadState(h.state); !st.Unpublished {
		t.Errorf("state.json should record unpublished changes: %+v", st)
	}
}

// takeLeaseOver has another host take the writer lease of the local store
// at storeDir over, as it would after our lease went stale (a long network
// partition): it rewrites the lease object. It returns once the daemon d,
// mounted at mp, reports the lease lost.
func takeLeaseOver(t *testing.T, h *host, d *daemonProc, mp, storeDir string) *uploader.Local {
	t.Helper()
	now := time.Now().UTC()
	rec := fmt.Sprintf(`{"holder":"intruder","host":"elsewhere","token":"t","generation":99,"acquired":%q,"renewed":%q,"expires":%q,"write":"w"}`,
		now.Format(time.RFC3339Nano), now.Format(time.RFC3339Nano), now.Add(time.Hour).Format(time.RFC3339Nano))
	ls, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ls.Put(t.Context(), uploader.LeaseKey, strings.NewReader(rec), int64(len(rec)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	// The heartbeat (every 10s) finds it.
	deadline := time.Now().Add(30 * time.Second)
	var r daemon.StatusReport
	for time.Now().Before(deadline) {
		if r, _ = h.statusJSON(mp); r.Lease == "lost" {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if r.Lease != "lost" || !strings.Contains(r.LastError, "lease") {
		t.Fatalf("status after a takeover: lease %q, last error %q\n%s", r.Lease, r.LastError, d.stderr)
	}
	return ls
}

// A host that lost the lease with nothing to publish, after another host
// published and went away: its snapshots are "nothing changed" and it
// stops cleanly (exit 0), with no conflict to resolve at the next start.
func TestE2ELeaseLostIdle(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "before.txt"), "published", 0o644)
	if code, _, errOut := h.run("snapshot", mp); code != 0 {
		t.Fatalf("snapshot: %d %s", code, errOut)
	}
	ls := takeLeaseOver(t, h, d, mp, storeDir)
	publishTree(t, uploader.NewCatalog(ls, uploader.CatalogOptions{Host: "elsewhere"}), makeTree(t, 99))
	if err := ls.Delete(t.Context(), uploader.LeaseKey); err != nil {
		t.Fatal(err)
	}
	if code, _, errOut := h.run("snapshot", mp); code != 0 {
		t.Errorf("snapshot with nothing changed after losing the lease: exit %d, want 0: %s", code, errOut)
	}
	d.stopOK(t)
	if st, err := daemon.ReadState(h.state); err != nil || st.Unpublished || !st.CleanShutdown {
		t.Errorf("state after an idle stop: %+v %v", st, err)
	}
}

func TestE2EUnmountedFromOutside(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	for _, unpublished := range []bool{false, true} {
		mp := e2eDir(t, "home")
		h := newHost(t, "file://"+storeDir)
		d := h.mount(mp, "--interval", "0")
		writeFile(t, filepath.Join(mp, "a.txt"), "a", 0o644)
		if code, _, errOut := h.run("snapshot", mp); code != 0 {
			t.Fatalf("snapshot: %d %s", code, errOut)
		}
		if unpublished {
			writeFile(t, filepath.Join(mp, "b.txt"), "b", 0o644)
		}
		if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
		code := d.wait()
		st, _ := daemon.ReadState(h.state)
		if unpublished {
			if code != exitUnsynced || !st.Unpublished {
				t.Errorf("unmounted from outside with a change after the last snapshot: exit %d, state %+v", code, st)
			}
			if got := mustRead(t, filepath.Join(h.state, "upper", "b.txt")); got != "b" {
				t.Errorf("upper not kept: %q", got)
			}
		} else if code != 0 || st.Unpublished || !st.CleanShutdown {
			t.Errorf("unmounted from outside with everything published: exit %d, state %+v\n%s", code, st, d.stderr)
		}
	}
}

// TestE2ECorruptSnapshotFallback: the newest snapshot damaged in the
// store (a byte of its own segment that its image uses, or its extents
// list) is skipped by a new host's boot, loudly (log, status), for the one
// before; the next publish replaces the damaged LATEST, on the good one.
func TestE2ECorruptSnapshotFallback(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "unsquashfs")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	a := newHost(t, "file://"+storeDir)
	d := a.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "v.txt"), "version 1", 0o644)
	_, out, _ := a.run("snapshot", mp)
	id1 := strings.TrimSpace(out)
	writeFile(t, filepath.Join(mp, "v.txt"), "version 2", 0o644)
	if c := d.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop: %d", c)
	}
	id2 := localLatest(t, storeDir)
	if id1 == "" || id2 == id1 {
		t.Fatalf("snapshots %q %q", id1, id2)
	}
	m2 := readManifest(t, storeDir, id2)
	own := ownSegment(t, m2)
	// A byte of id2's own segment that its image uses: the extent of the
	// image's tables, which every boot reads.
	x := storeExtents(t, storeDir, m2).Slice(m2.MetaOffset, 1)[0]
	if x.Key != own.Key {
		t.Fatalf("the tables of %s are in %s, not in its own segment", id2, x.Key)
	}
	damage := map[string]func(undo bool){
		"segment": func(bool) { flipStored(t, storeDir, own.Key, x.Offset, 0x40) },
		"extents": func(bool) { flipStored(t, storeDir, m2.Extents, int64(len(own.Key))+1, 0x01) },
	}
	for _, what := range []string{"segment", "extents"} {
		damage[what](false)
		h := newHost(t, "file://"+storeDir)
		mpB := e2eDir(t, "homeB")
		db := h.mount(mpB, "--interval", "0")
		if !strings.Contains(db.ready, "snapshot="+id1) {
			t.Errorf("%s damaged: ready line %q: want the previous good snapshot %s", what, db.ready, id1)
		}
		if got := mustRead(t, filepath.Join(mpB, "v.txt")); got != "version 1" {
			t.Errorf("%s damaged: v.txt = %q", what, got)
		}
		r, _ := h.statusJSON(mpB)
		if !strings.Contains(r.LastError, id2) || !strings.Contains(r.LastError, "corrupt") {
			t.Errorf("%s damaged: status should tell of the corrupt snapshot %s: %q", what, id2, r.LastError)
		}
		if log := db.stderr.String(); !strings.Contains(log, "fell back to an older one") || what == "segment" && !strings.Contains(log, own.Key) {
			t.Errorf("%s damaged: the log does not say what it skipped and why:\n%s", what, log)
		}
		if what == "segment" {
			// Read-only from here: this host leaves the store as it is.
			if c := db.stop(syscall.SIGTERM); c != 0 {
				t.Fatalf("stop B: %d\n%s", c, db.stderr)
			}
			damage[what](true)
			continue
		}
		// The next publish replaces the corrupt LATEST.
		writeFile(t, filepath.Join(mpB, "v.txt"), "version 3", 0o644)
		if c := db.stop(syscall.SIGTERM); c != 0 {
			t.Fatalf("stop B: %d\n%s", c, db.stderr)
		}
		got := localLatest(t, storeDir)
		if got == id2 || got == id1 {
			t.Fatalf("LATEST still %s", got)
		}
		m := readManifest(t, storeDir, got)
		if m.Parent != id1 {
			t.Errorf("the snapshot after the fallback has parent %s, want %s", m.Parent, id1)
		}
		for _, r := range m.Segments {
			if r.Key == own.Key {
				t.Errorf("the snapshot after the fallback uses the damaged snapshot's segment %s", r.Key)
			}
		}
		if v := mustRead(t, filepath.Join(unsquash(t, localImage(t, storeDir, got)), "v.txt")); v != "version 3" {
			t.Errorf("the snapshot after the fallback: v.txt = %q", v)
		}
	}
}

// A crash right after a publish, before state.json recorded it: the next
// start recognises LATEST as its own snapshot, not another host's.
func TestE2ECrashAfterPublish(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "a"), "a", 0o644)
	_, out, _ := h.run("snapshot", mp)
	id1 := strings.TrimSpace(out)
	writeFile(t, filepath.Join(mp, "b"), "b", 0o644)
	if code, _, _ := h.run("snapshot", mp); code != 0 {
		t.Fatal("snapshot")
	}
	writeFile(t, filepath.Join(mp, "c"), "c", 0o644)
	d.cmd.Process.Kill()
	d.wait()
	syscall.Unmount(mp, syscall.MNT_DETACH)
	// Roll state.json back to before the second publish was recorded.
	st, err := daemon.ReadState(h.state)
	if err != nil {
		t.Fatal(err)
	}
	st.LastPublished = id1
	b, _ := json.Marshal(st)
	writeFile(t, filepath.Join(h.state, "state.json"), string(b), 0o600)

	d2 := h.mount(mp, "--interval", "0")
	for _, f := range []string{"a", "b", "c"} {
		if got := mustRead(t, filepath.Join(mp, f)); got != f {
			t.Errorf("%s = %q", f, got)
		}
	}
	d2.stopOK(t)
	out2 := unsquashLatest(t, storeDir)
	if got := mustRead(t, filepath.Join(out2, "c")); got != "c" {
		t.Errorf("c not published: %q", got)
	}
}

// A crash in the very first publish, with the segment, its digests, the
// extents list and the manifest up but LATEST not yet written: the next
// start finds a complete snapshot and no LATEST. The segment the crash
// left in pack/ proves the snapshot is ours, so the local changes are
// mounted and published, not reported as a conflict with another host.
func TestE2ECrashBeforeFirstLatest(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "strace")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "a"), "a", 0o644)
	sc := straceKill(t, d.cmd.Process.Pid, filepath.Join(storeDir, "LATEST"))
	h.run("snapshot", mp) // the daemon dies under it
	d.wait()
	<-sc
	if d.code != 128+int(syscall.SIGKILL) {
		t.Fatalf("the daemon was not killed at LATEST: exit %d\n%s", d.code, d.stderr)
	}
	if _, err := os.Stat(filepath.Join(storeDir, "LATEST")); err == nil {
		t.Fatal("LATEST exists: the kill came too late to test anything")
	}
	syscall.Unmount(mp, syscall.MNT_DETACH)
	// The store holds the complete snapshot, not published.
	snaps := localSnapshots(t, storeDir)
	if len(snaps) != 1 {
		t.Fatalf("%d manifests in the store after the crash, want 1", len(snaps))
	}
	m := readManifest(t, storeDir, strings.TrimSuffix(filepath.Base(snaps[0]), ".json"))
	checkStoreRefs(t, storeCatalog(t, "file://"+storeDir))
	// A read-only mount in between leaves the proof to the writer.
	h.mount(mp, "--read-only").stopOK(t)
	if fi, err := os.Stat(filepath.Join(h.state, "pack", "next.seg")); err != nil || fi.Size() != m.NewBytes {
		t.Fatalf("the crash's segment is not in pack/ after a read-only mount (%d bytes of its %d wanted): %v", infoSize(fi), m.NewBytes, err)
	}

	d2 := h.mount(mp, "--interval", "0")
	if got := mustRead(t, filepath.Join(mp, "a")); got != "a" {
		t.Errorf("a = %q", got)
	}
	if strings.Contains(d2.stderr.String(), "another host") {
		t.Errorf("the start took its own snapshot for another host's:\n%s", d2.stderr)
	}
	d2.stopOK(t)
	out := unsquashLatest(t, storeDir)
	if got := mustRead(t, filepath.Join(out, "a")); got != "a" {
		t.Errorf("a not published: %q", got)
	}
}

func infoSize(fi os.FileInfo) int64 {
	if fi == nil {
		return -1
	}
	return fi.Size()
}

// After a clean stop that could not rebase, the upper layer holds changes
// already published. Started against a store that does not hold that
// snapshot (an emptied prefix, another --store), the daemon must publish
// them again, not drop them as "published".
func TestE2EPublishedUpperKeptForAnotherStore(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "unsquashfs")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "a"), "a", 0o644)
	d.stopOK(t)
	// What a stop that could not rebase leaves: a clean, published state
	// with the published change still in the upper layer.
	st, err := daemon.ReadState(h.state)
	if err != nil || !st.CleanShutdown || st.Unpublished {
		t.Fatalf("state after a clean stop: %+v %v", st, err)
	}
	writeFile(t, filepath.Join(h.state, "upper", "b"), "b", 0o644)

	other := e2eDir(t, "other-store")
	h.store = "file://" + other
	d2 := h.mount(mp, "--interval", "0")
	if got := mustRead(t, filepath.Join(mp, "b")); got != "b" {
		t.Errorf("b = %q", got)
	}
	d2.stopOK(t)
	if got := mustRead(t, filepath.Join(unsquashLatest(t, other), "b")); got != "b" {
		t.Errorf("b not published to the new store: %q", got)
	}
}

// A host that changed nothing and stopped cleanly never blocks on a
// conflict when another host published meanwhile.
func TestE2EIdleHostRestart(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	mpA, mpB := e2eDir(t, "homeA"), e2eDir(t, "homeB")
	a, b := newHost(t, store), newHost(t, store)
	db := b.mount(mpB, "--interval", "0")
	writeFile(t, filepath.Join(mpB, "f"), "1", 0o644)
	if c := db.stop(syscall.SIGTERM); c != 0 {
		t.Fatal("stop B")
	}
	da := a.mount(mpA, "--interval", "0")
	if got := mustRead(t, filepath.Join(mpA, "f")); got != "1" {
		t.Fatalf("A sees %q", got)
	}
	if c := da.stop(syscall.SIGTERM); c != 0 {
		t.Fatal("stop A")
	}
	db = b.mount(mpB, "--interval", "0")
	writeFile(t, filepath.Join(mpB, "f"), "2", 0o644)
	if c := db.stop(syscall.SIGTERM); c != 0 {
		t.Fatal("stop B")
	}
	da = a.mount(mpA, "--interval", "0")
	if got := mustRead(t, filepath.Join(mpA, "f")); got != "2" {
		t.Errorf("A after B published again sees %q", got)
	}
	if c := da.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop A: %d\n%s", c, da.stderr)
	}
}

// The S3 server goes away before SIGTERM: exit 5 within the stop timeout,
// the upper layer kept; once the server is back the next start publishes.
func TestE2ES3DownAtSigterm(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "unsquashfs")
	data := e2eDir(t, "s3data")
	srv := launchS3(t, data, "hermes-e2e")
	url := func(ep string) string { return fmt.Sprintf("s3://hermes-e2e/h?endpoint=%s&path_style=true", ep) }
	mp := e2eDir(t, "home")
	h := newHost(t, url(srv.Endpoint))
	d := h.mount(mp, "--interval", "0", "--stop-timeout", "30s")
	writeFile(t, filepath.Join(mp, "precious.txt"), "do not lose me", 0o644)
	srv.Close()
	t0 := time.Now()
	if code := d.stop(syscall.SIGTERM); code != exitUnsynced {
		t.Fatalf("SIGTERM with S3 down: exit %d, want %d\n%s", code, exitUnsynced, d.stderr)
	}
	if el := time.Since(t0); el > 45*time.Second {
		t.Errorf("stop took %s, past --stop-timeout 30s", el)
	}
	if got := mustRead(t, filepath.Join(h.state, "upper", "precious.txt")); got != "do not lose me" {
		t.Fatalf("upper layer not kept: %q", got)
	}

	srv = launchS3(t, data, "") // same data, new port
	h.store = url(srv.Endpoint)
	d2 := h.mount(mp, "--interval", "0")
	deadline := time.Now().Add(60 * time.Second)
	for time.Now().Before(deadline) {
		if r, _ := h.statusJSON(mp); r.Snapshots > 0 {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	d2.stopOK(t)
	mpB := e2eDir(t, "homeB")
	b := newHost(t, url(srv.Endpoint))
	db := b.mount(mpB)
	if got := mustRead(t, filepath.Join(mpB, "precious.txt")); got != "do not lose me" {
		t.Errorf("new host after the store came back: %q", got)
	}
	db.stop(syscall.SIGTERM)
}

func TestE2EKeepLocal(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	mpA, mpB := e2eDir(t, "homeA"), e2eDir(t, "homeB")
	a, b := newHost(t, store), newHost(t, store)
	da := a.mount(mpA, "--interval", "0")
	writeFile(t, filepath.Join(mpA, "a.txt"), "a", 0o644)
	if c := da.stop(syscall.SIGTERM); c != 0 {
		t.Fatal("stop A")
	}
	// What a failed final upload leaves in A's state dir (its lease was
	// released, so B need not wait for it to go stale).
	writeFile(t, filepath.Join(a.state, "upper", "local.txt"), "mine", 0o644)
	st, _ := daemon.ReadState(a.state)
	st.Unpublished, st.CleanShutdown = true, false
	j, _ := json.Marshal(st)
	writeFile(t, filepath.Join(a.state, "state.json"), string(j), 0o600)

	db := b.mount(mpB, "--interval", "0")
	writeFile(t, filepath.Join(mpB, "b.txt"), "b", 0o644)
	if c := db.stop(syscall.SIGTERM); c != 0 {
		t.Fatal("stop B")
	}
	theirs := localLatest(t, storeDir)
	if c := a.start(mpA).wait(); c != exitConflict {
		t.Fatalf("A without --on-conflict: exit %d", c)
	}
	da = a.mount(mpA, "--interval", "0", "--on-conflict", "keep-local")
	if mustRead(t, filepath.Join(mpA, "local.txt")) != "mine" || mustRead(t, filepath.Join(mpA, "a.txt")) != "a" {
		t.Error("keep-local does not show our tree")
	}
	if _, err := os.Stat(filepath.Join(mpA, "b.txt")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("keep-local shows their change: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for localLatest(t, storeDir) == theirs && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	if c := da.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop A: %d\n%s", c, da.stderr)
	}
	ours := localLatest(t, storeDir)
	if ours == theirs {
		t.Fatal("keep-local did not publish over theirs")
	}
	out := unsquash(t, localImage(t, storeDir, ours))
	if mustRead(t, filepath.Join(out, "local.txt")) != "mine" {
		t.Error("published tree lacks our change")
	}
	// Theirs is still in the store, only no longer LATEST.
	if _, err := os.Stat(filepath.Join(storeDir, "snapshots", theirs+".json")); err != nil {
		t.Errorf("their snapshot: %v", err)
	}
}

// The memory hook reads the home's config.yaml from the layers, not
// through the mount: from the lower archive, then the upper layer, and not
// at all once deleted.
func TestE2EMemoryLimitsFromConfig(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := filepath.Join(e2eDir(t, "home"), "h")
	writeFile(t, filepath.Join(mp, "config.yaml"), "memory:\n  memory_char_limit: 100\n", 0o644)
	writeFile(t, filepath.Join(mp, "memories", "MEMORY.md"), "short", 0o644)
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0")
	mem := filepath.Join(mp, "memories", "MEMORY.md")
	text := strings.Repeat("é", 150)
	if err := os.WriteFile(mem, []byte(text), 0o644); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("150 characters under a limit of 100 (config.yaml in the archive): %v", err)
	}
	if got := mustRead(t, mem); got != "short" {
		t.Errorf("rejected write changed MEMORY.md: %q", got)
	}
	writeFile(t, filepath.Join(mp, "config.yaml"), "memory:\n  memory_char_limit: 200\n", 0o644)
	if err := os.WriteFile(mem, []byte(text), 0o644); err != nil {
		t.Errorf("150 characters under a limit of 200 (config.yaml in the upper layer): %v", err)
	}
	if err := os.Remove(filepath.Join(mp, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(mem, []byte(strings.Repeat("é", 1000)), 0o644); err != nil {
		t.Errorf("1000 characters with config.yaml deleted (default 2200): %v", err)
	}
	if err := os.WriteFile(mem, []byte(strings.Repeat("é", 2300)), 0o644); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("2300 characters with the default limit: %v", err)
	}
	if c := d.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop: %d", c)
	}
	audit := mustRead(t, filepath.Join(h.state, "audit.jsonl"))
	if strings.Count(audit, `"verdict":"rejected"`) != 2 || strings.Count(audit, `"verdict":"accepted"`) != 2 {
		t.Errorf("audit log:\n%s", audit)
	}
}

// A first mount from a store that already holds snapshots, over a directory
// that is not empty (a new host whose agent wrote before the mount came
// up), takes the directory's files into the home: new ones at their paths,
// one the home holds otherwise beside it, named in a warning; they are
// still underneath, untouched, after unmount.
func TestE2EAdoptsExistingFilesOnNewHost(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	mpA, mpB := e2eDir(t, "homeA"), e2eDir(t, "homeB")
	da := newHost(t, store).mount(mpA, "--interval", "0")
	writeFile(t, filepath.Join(mpA, "from-store"), "published", 0o644)
	if c := da.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop A: %d\n%s", c, da.stderr)
	}
	writeFile(t, filepath.Join(mpB, "local-only"), "mine", 0o600)
	writeFile(t, filepath.Join(mpB, "from-store"), "B's own", 0o644)
	db := newHost(t, store).mount(mpB, "--interval", "0")
	if !strings.Contains(db.stderr.String(), "written into the mountpoint directory while no mount covered it") ||
		!strings.Contains(db.stderr.String(), "local-only") || !strings.Contains(db.stderr.String(), "pass --store") {
		t.Errorf("no warning naming the files taken in:\n%s", db.stderr)
	}
	if got := mustRead(t, filepath.Join(mpB, "from-store")); got != "published" {
		t.Errorf("mount shows %q", got)
	}
	if got := mustRead(t, filepath.Join(mpB, "local-only")); got != "mine" {
		t.Errorf("the mount shows local-only as %q", got)
	}
	beside, _ := filepath.Glob(filepath.Join(mpB, "from-store.underneath-*"))
	if len(beside) != 1 || mustRead(t, beside[0]) != "B's own" {
		t.Errorf("B's own from-store is not beside the home's: %v", beside)
	}
	if c := db.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop B: %d\n%s", c, db.stderr)
	}
	if got := mustRead(t, filepath.Join(mpB, "local-only")); got != "mine" {
		t.Errorf("after unmount the file underneath reads %q", got)
	}
	if got := mustRead(t, filepath.Join(mpB, "from-store")); got != "B's own" {
		t.Errorf("after unmount from-store underneath reads %q", got)
	}
}
