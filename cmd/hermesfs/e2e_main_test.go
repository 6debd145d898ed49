package main

// Helpers for the end-to-end tests: they run the real hermesfs binary in a
// subprocess, as a user or a service manager would, and look at the mount,
// the state dir and the store from outside.

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/mounttest"
	"github.com/hermesfs/hermesfs/fs/testwatch"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/s3test"
)

var (
	binOnce sync.Once
	binPath string
	binErr  error
	tmpRoot string // every test mount lives below it (checked at exit)
)

// e2eParallel is how many tests run at once by default (-test.parallel,
// or HERMESFS_E2E_PARALLEL, says otherwise). The end-to-end tests spend
// most of their time waiting on daemons, timers and the store, not on the
// CPU; each has its own dirs, store, daemons and S3 server.
const e2eParallel = 4

func TestMain(m *testing.M) {
	// The suite's daemons run without write-back unless a test asks for it
	// (--write-back): a test that takes its own snapshots must not race one.
	// TestWriteBackDefault checks the default.
	os.Setenv("HERMESFS_WRITE_BACK", "0")
	// Every S3 server of these tests (versitygw on loopback, s3test)
	// takes the same credentials: set once here for the daemons and the
	// tests' own clients, as t.Setenv cannot be used by parallel tests. A
	// test of missing credentials clears them (a sequential test can).
	os.Setenv("AWS_ACCESS_KEY_ID", s3test.AccessKey)
	os.Setenv("AWS_SECRET_ACCESS_KEY", s3test.SecretKey)
	os.Setenv("AWS_REGION", s3test.Region)
	flag.Parse()
	given := false
	flag.Visit(func(f *flag.Flag) { given = given || f.Name == "test.parallel" })
	if !given {
		n := strconv.Itoa(e2eParallel)
		if v := os.Getenv("HERMESFS_E2E_PARALLEL"); v != "" {
			n = v
		}
		flag.Set("test.parallel", n)
	}
	// A hung test fails the package at its deadline (testwatch), not at
	// -timeout: the daemons and mounts of every test go first.
	testwatch.OnExpire(killDaemons)
	mounttest.Main(m, "hermesfs-e2e", &tmpRoot)
}

// daemons are the `hermesfs mount` processes the tests started, for
// killDaemons.
var daemons sync.Map // *exec.Cmd -> mountpoint

// killDaemons kills every daemon the tests started and detaches their
// mounts: the process is about to exit on a hung test.
func killDaemons() {
	daemons.Range(func(k, v any) bool {
		k.(*exec.Cmd).Process.Kill()
		syscall.Unmount(v.(string), syscall.MNT_DETACH)
		return true
	})
	for _, mp := range fs.MountsBelow(tmpRoot) {
		syscall.Unmount(mp, syscall.MNT_DETACH)
	}
}

func strict() bool { return os.Getenv("HERMESFS_TEST_STRICT") == "1" }

// need skips (or, under HERMESFS_TEST_STRICT=1, fails) when a tool is missing.
func need(t *testing.T, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if tool == "/dev/fuse" {
			if _, err := os.Stat("/dev/fuse"); err != nil {
				missing(t, "/dev/fuse")
			}
			continue
		}
		if _, err := exec.LookPath(tool); err != nil {
			missing(t, tool)
		}
	}
}

func missing(t *testing.T, what string) {
	t.Helper()
	if strict() {
		t.Fatalf("%s is missing (HERMESFS_TEST_STRICT=1)", what)
	}
	t.Skipf("%s is missing", what)
}

// hermesfsBin returns the binary under test: $HERMESFS_BIN, else one built
// once for this test run (with the race detector when the tests have it,
// so the daemon's own goroutines are checked too).
func hermesfsBin(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		if b := os.Getenv("HERMESFS_BIN"); b != "" {
			binPath, binErr = filepath.Abs(b)
			return
		}
		binPath = filepath.Join(tmpRoot, "bin", "hermesfs")
		args := []string{"build", "-o", binPath}
		if raceEnabled {
			args = append(args, "-race")
		}
		cmd := exec.Command("go", append(args, ".")...)
		if !raceEnabled {
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		}
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// e2eDir is a fresh directory below tmpRoot (t.TempDir's names are long and
// live elsewhere; mounts must stay below tmpRoot for the leak check).
func e2eDir(t *testing.T, name string) string {
	t.Helper()
	d, err := os.MkdirTemp(tmpRoot, strings.ReplaceAll(t.Name(), "/", "_")+"-"+name+"-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if len(fs.MountsBelow(d)) == 0 {
			os.RemoveAll(d)
		}
	})
	return d
}

// host is one simulated machine: a state dir and a runtime dir of its own,
// against a store shared by all hosts of a test.
type host struct {
	t        *testing.T
	state    string
	runtime  string
	store    string
	extraEnv []string
	// wrap, if set, runs the daemon of start through this command line
	// (the daemon's own command line appended).
	wrap []string
}

func newHost(t *testing.T, store string) *host {
	return &host{t: t, state: e2eDir(t, "state"), runtime: e2eDir(t, "run"), store: store}
}

func (h *host) env() []string {
	env := append(os.Environ(),
		"HERMESFS_STORE="+h.store,
		"HERMESFS_STATE_DIR="+h.state,
		"HERMESFS_RUNTIME_DIR="+h.runtime,
		"HERMESFS_LOG_LEVEL=debug",
		"NOTIFY_SOCKET=",
	)
	return append(env, h.extraEnv...)
}

// run runs a hermesfs command to completion.
func (h *host) run(args ...string) (code int, stdout, stderr string) {
	h.t.Helper()
	defer testwatch.Wait(h.t, fmt.Sprintf("'hermesfs %s' to exit", strings.Join(args, " ")))()
	cmd := exec.Command(hermesfsBin(h.t), args...)
	cmd.Env = h.env()
	cmd.Dir = "/"
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code = 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		h.t.Fatalf("hermesfs %v: %v", args, err)
	}
	return code, out.String(), errb.String()
}

// daemon is a running `hermesfs mount`.
type daemonProc struct {
	t       *testing.T
	cmd     *exec.Cmd
	mp      string
	ready   string
	stderr  *syncBuffer
	done    chan struct{}
	code    int
	readyCh chan string
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// start starts `hermesfs mount` on mp without waiting for ready.
func (h *host) start(mp string, args ...string) *daemonProc {
	h.t.Helper()
	t := h.t
	argv := append([]string{hermesfsBin(t), "mount"}, append(args, mp)...)
	if h.wrap != nil {
		argv = append(append([]string(nil), h.wrap...), argv...)
	}
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = h.env()
	cmd.Dir = "/"
	d := &daemonProc{t: t, cmd: cmd, mp: mp, stderr: &syncBuffer{}, done: make(chan struct{})}
	cmd.Stderr = d.stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	daemons.Store(cmd, mp)
	readyCh := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		sent := false
		for sc.Scan() {
			if !sent && strings.HasPrefix(sc.Text(), "ready ") {
				readyCh <- sc.Text()
				sent = true
			}
		}
		close(readyCh)
	}()
	go func() {
		err := cmd.Wait()
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			d.code = ee.ExitCode()
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				d.code = 128 + int(ws.Signal())
			}
		}
		daemons.Delete(cmd)
		close(d.done)
	}()
	t.Cleanup(func() {
		select {
		case <-d.done:
		default:
			d.cmd.Process.Signal(syscall.SIGTERM)
			select {
			case <-d.done:
			case <-time.After(60 * time.Second):
				d.cmd.Process.Kill()
				d.exited(120 * time.Second)
			}
		}
		if fs.IsMountpoint(mp) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
	})
	d.readyCh = readyCh
	return d
}

// mount starts `hermesfs mount` on mp and waits for its ready line.
func (h *host) mount(mp string, args ...string) *daemonProc {
	h.t.Helper()
	d := h.start(mp, args...)
	d.waitReady()
	return d
}

func (d *daemonProc) waitReady() {
	d.t.Helper()
	defer testwatch.Wait(d.t, "the ready line of 'hermesfs mount "+d.mp+"'")()
	select {
	case line, ok := <-d.readyCh:
		if !ok {
			<-d.done
			d.t.Fatalf("hermesfs mount exited %d before ready:\n%s", d.code, d.stderr)
		}
		d.ready = line
	case <-time.After(90 * time.Second):
		d.t.Fatalf("hermesfs mount: no ready line after 90s:\n%s", d.stderr)
	}
	if !fs.IsMountpoint(d.mp) {
		d.t.Fatalf("ready, but %s is not a mountpoint", d.mp)
	}
}

// wait waits for the daemon to exit and returns its exit code.
func (d *daemonProc) wait() int {
	d.t.Helper()
	if !d.exited(120 * time.Second) {
		d.t.Fatalf("hermesfs did not exit within 120s:\n%s", d.stderr)
	}
	return d.code
}

// exited waits up to limit for the daemon to exit. A daemon killed while
// one of its own threads waited on its own mount (the freeze's held chmod)
// never exits by itself: after 15s its FUSE connection is aborted, as a
// restart of hermesfs does, which frees that thread.
func (d *daemonProc) exited(limit time.Duration) bool {
	defer testwatch.Wait(d.t, "'hermesfs mount "+d.mp+"' to exit")()
	select {
	case <-d.done:
		return true
	case <-time.After(15 * time.Second):
	}
	if fs.IsMountpoint(d.mp) && daemon.ProbeFUSE(d.mp, time.Second) == daemon.FUSEHung {
		err := fs.AbortConnection(d.mp, slog.Default())
		d.t.Logf("the daemon did not exit and its mount hangs: aborted its connection (err %v)", err)
	}
	select {
	case <-d.done:
		return true
	case <-time.After(limit):
		return false
	}
}

// stop sends sig and waits for the exit code.
func (d *daemonProc) stop(sig syscall.Signal) int {
	d.t.Helper()
	d.cmd.Process.Signal(sig)
	return d.wait()
}

// entry is what the tree comparison checks of one file.
type entry struct {
	Mode  iofs.FileMode
	Size  int64
	Hash  string // content sha256 (regular files)
	Link  string // symlink target
	Mtime int64  // seconds (regular files and symlinks)
}

// snapshotTree describes every entry below dir by relative path. SQLite's
// -shm files are skipped: their content is a cache SQLite rebuilds.
func snapshotTree(t *testing.T, dir string) map[string]entry {
	t.Helper()
	out := map[string]entry{}
	err := filepath.WalkDir(dir, func(p string, de iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." || strings.HasSuffix(rel, "-shm") {
			return nil
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		e := entry{Mode: fi.Mode()}
		switch {
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			s := sha256.Sum256(b)
			e.Hash, e.Size, e.Mtime = hex.EncodeToString(s[:]), fi.Size(), fi.ModTime().Unix()
		case fi.Mode()&iofs.ModeSymlink != 0:
			e.Link, _ = os.Readlink(p)
			e.Mtime = fi.ModTime().Unix()
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", dir, err)
	}
	return out
}

func diffTrees(want, got map[string]entry) string {
	var diffs []string
	for k, w := range want {
		g, ok := got[k]
		switch {
		case !ok:
			diffs = append(diffs, "missing "+k)
		case g != w:
			diffs = append(diffs, fmt.Sprintf("%s: want %+v, got %+v", k, w, g))
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			diffs = append(diffs, "unexpected "+k)
		}
	}
	sort.Strings(diffs)
	if len(diffs) > 20 {
		diffs = append(diffs[:20], fmt.Sprintf("... %d more", len(diffs)-20))
	}
	return strings.Join(diffs, "\n")
}

// sqlite runs sql on db with the sqlite3 CLI.
func sqlite(t *testing.T, db, sql string) string {
	t.Helper()
	out, err := exec.Command("sqlite3", db, sql).CombinedOutput()
	if err != nil {
		t.Fatalf("sqlite3 %s %q: %v\n%s", db, sql, err, out)
	}
	return strings.TrimSpace(string(out))
}

func integrityOK(t *testing.T, db string) {
	t.Helper()
	if got := sqlite(t, db, "PRAGMA integrity_check;"); got != "ok" {
		t.Fatalf("%s: integrity_check: %s", db, got)
	}
}

// statusJSON runs `hermesfs status --json MP`.
func (h *host) statusJSON(mp string) (daemon.StatusReport, int) {
	h.t.Helper()
	code, out, errOut := h.run("status", "--json", mp)
	var r daemon.StatusReport
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		h.t.Fatalf("status --json: exit %d, %v:\n%s\n%s", code, err, out, errOut)
	}
	return r, code
}

// localSnapshots lists the snapshots (their manifests) of a local store,
// oldest first.
func localSnapshots(t *testing.T, storeDir string) []string {
	t.Helper()
	names, _ := filepath.Glob(filepath.Join(storeDir, "snapshots", "*.json"))
	sort.Strings(names)
	return names
}

// localImage writes snapshot id of the local store at storeDir as one
// squashfs image and returns its path: the README's recipe, with nothing
// but the store's files. A format 4 snapshot is put together from its
// extents list (each line a range of a segment file; an encrypted
// segment's plaintext, decrypted with the identity files ids); an older
// one is its archive object.
func localImage(t *testing.T, storeDir, id string, ids ...string) string {
	t.Helper()
	var m uploader.Manifest
	if err := json.Unmarshal([]byte(mustRead(t, filepath.Join(storeDir, "snapshots", id+".json"))), &m); err != nil {
		t.Fatalf("manifest of %s: %v", id, err)
	}
	if !m.Segmented() {
		return filepath.Join(storeDir, filepath.FromSlash(m.Archive))
	}
	plain := map[string][]byte{}
	segment := func(key string) []byte {
		if b, ok := plain[key]; ok {
			return b
		}
		b, err := os.ReadFile(filepath.Join(storeDir, filepath.FromSlash(key)))
		if err != nil {
			t.Fatalf("segment %s of %s: %v", key, id, err)
		}
		if crypt.IsEncrypted(b) {
			ident, err := crypt.LoadIdentities(ids)
			if err != nil {
				t.Fatalf("segment %s of %s is encrypted: %v", key, id, err)
			}
			r, err := crypt.NewReader(bytes.NewReader(b), ident)
			if err == nil {
				b, err = io.ReadAll(r)
			}
			if err != nil {
				t.Fatalf("decrypt segment %s of %s: %v", key, id, err)
			}
		}
		plain[key] = b
		return b
	}
	var img []byte
	for line := range strings.Lines(mustRead(t, filepath.Join(storeDir, filepath.FromSlash(m.Extents)))) {
		var key string
		var off, n int64
		if _, err := fmt.Sscan(line, &key, &off, &n); err != nil {
			t.Fatalf("extents of %s: %q: %v", id, line, err)
		}
		img = append(img, segment(key)[off:off+n]...)
	}
	p := filepath.Join(e2eDir(t, "image"), id+".sqfs")
	if err := os.WriteFile(p, img, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func localLatest(t *testing.T, storeDir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(storeDir, "LATEST"))
	if err != nil {
		t.Fatalf("LATEST: %v", err)
	}
	return strings.TrimSpace(string(b))
}

// stopOK stops the daemon with SIGTERM and fails the test unless it exits 0.
func (d *daemonProc) stopOK(t *testing.T) {
	t.Helper()
	if c := d.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop: exit %d\n%s", c, d.stderr)
	}
}

// unsquashLatest extracts the archive LATEST names in the local store at
// storeDir with the standard tool.
func unsquashLatest(t *testing.T, storeDir string) string {
	t.Helper()
	return unsquash(t, localImage(t, storeDir, localLatest(t, storeDir)))
}

// launchS3 runs versitygw on loopback over data (a relaunch on the same
// data serves the same objects on a new port) until the test ends, creates
// bucket unless it is "" (the credentials are in the environment: TestMain).
func launchS3(t *testing.T, data, bucket string) *s3test.Server {
	t.Helper()
	bin, err := s3test.Binary()
	if err != nil {
		missing(t, "versitygw")
	}
	srv, err := s3test.Launch(bin, data, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	if bucket != "" {
		if err := srv.CreateBucket(t.Context(), bucket); err != nil {
			t.Fatal(err)
		}
	}
	return srv
}

// unsquash extracts archive into a fresh dir with the standard tool.
func unsquash(t *testing.T, archive string) string {
	t.Helper()
	dst := filepath.Join(e2eDir(t, "unsquash"), "root")
	out, err := exec.Command("unsquashfs", "-no-progress", "-d", dst, archive).CombinedOutput()
	if err != nil {
		t.Fatalf("unsquashfs %s: %v\n%s", archive, err, out)
	}
	return dst
}

func writeFile(t *testing.T, p, content string, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
}

func mustRead(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
