package main

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
)

// pwriterEnv makes this test binary a writer process instead of running
// the tests: "sync:PATH" writes an increasing counter at offset 0 of PATH
// with pwrite + fsync and prints "ack N" once both returned, until one
// fails; "random:PATH" prints "open", then writes 4 KiB blocks at random
// offsets within PATH's size until killed.
const pwriterEnv = "HERMESFS_TEST_PWRITER"

func init() {
	if spec := os.Getenv(pwriterEnv); spec != "" {
		os.Exit(runPWriter(spec))
	}
}

func runPWriter(spec string) int {
	mode, path, _ := strings.Cut(spec, ":")
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	out := bufio.NewWriter(os.Stdout)
	var buf [4096]byte
	switch mode {
	case "sync":
		for seq := uint64(1); ; seq++ {
			binary.LittleEndian.PutUint64(buf[:], seq)
			if _, err := f.WriteAt(buf[:8], 0); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 0
			}
			if err := f.Sync(); err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 0
			}
			fmt.Fprintf(out, "ack %d\n", seq)
			out.Flush()
		}
	case "random":
		fi, err := f.Stat()
		if err != nil {
			return 1
		}
		blocks := fi.Size() / int64(len(buf))
		fmt.Fprintln(out, "open")
		out.Flush()
		for {
			f.WriteAt(buf[:], rand.Int64N(blocks)*int64(len(buf)))
		}
	}
	return 2
}

// pwriter is a writer process (pwriterEnv).
type pwriter struct {
	cmd    *exec.Cmd
	stderr syncBuffer
	mu     sync.Mutex
	last   int  // the last ack
	open   bool // "open" was printed
	lines  chan struct{}
	done   chan struct{}
}

func startPWriter(t *testing.T, mode, path string) *pwriter {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	w := &pwriter{cmd: exec.Command(self), lines: make(chan struct{}, 1), done: make(chan struct{})}
	w.cmd.Env = append(os.Environ(), pwriterEnv+"="+mode+":"+path)
	w.cmd.Dir = "/"
	w.cmd.Stderr = &w.stderr
	out, err := w.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			w.mu.Lock()
			if n, ok := strings.CutPrefix(sc.Text(), "ack "); ok {
				w.last, _ = strconv.Atoi(n)
			} else if sc.Text() == "open" {
				w.open = true
			}
			w.mu.Unlock()
			select {
			case w.lines <- struct{}{}:
			default:
			}
		}
		w.cmd.Wait()
		close(w.done)
	}()
	t.Cleanup(func() {
		w.cmd.Process.Kill()
		select {
		case <-w.done:
		case <-time.After(time.Minute):
			t.Errorf("writer %d did not exit a minute after SIGKILL", w.cmd.Process.Pid)
		}
	})
	return w
}

func (w *pwriter) state() (last int, open bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.last, w.open
}

// sqliteLoop commits transactions one at a time through the sqlite3 CLI
// (.bail on: it exits at its first error) and records which committed.
type sqliteLoop struct {
	cmd    *exec.Cmd
	stderr syncBuffer
	mu     sync.Mutex
	acked  []int
	done   chan struct{}
}

func startSQLiteLoop(t *testing.T, db string) *sqliteLoop {
	t.Helper()
	l := &sqliteLoop{cmd: exec.Command("sqlite3", db), done: make(chan struct{})}
	l.cmd.Dir = "/"
	l.cmd.Stderr = &l.stderr
	in, err := l.cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := l.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := l.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	fmt.Fprint(in, ".bail on\nPRAGMA journal_mode=WAL;\nCREATE TABLE IF NOT EXISTS t(n INTEGER PRIMARY KEY, pad BLOB);\nSELECT 'ack 0';\n")
	go func() {
		defer close(l.done)
		defer l.cmd.Wait()
		defer in.Close()
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			s, ok := strings.CutPrefix(sc.Text(), "ack ")
			if !ok {
				continue
			}
			n, _ := strconv.Atoi(s)
			if n > 0 {
				l.mu.Lock()
				l.acked = append(l.acked, n)
				l.mu.Unlock()
			}
			if _, err := fmt.Fprintf(in, "BEGIN; INSERT INTO t VALUES(%d, randomblob(1000)); COMMIT; SELECT 'ack %d';\n", n+1, n+1); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() { l.cmd.Process.Kill(); <-l.done })
	return l
}

func (l *sqliteLoop) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.acked)
}

// TestE2EStopWhileWriting: SIGTERM while the agent keeps committing
// SQLite transactions and pwrite + fsync-ing a file, neither of them
// stopped first: the daemon exits 0 well within its stop timeout; every
// transaction the writer saw commit, and every write whose fsync
// returned, is in the published snapshot; the writers' writes fail from
// the final snapshot's cut on.
func TestE2EStopWhileWriting(t *testing.T) {
	need(t, "/dev/fuse", "sqlite3", "unsquashfs")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	const stopTimeout = 30 * time.Second
	d := h.mount(mp, "--interval", "0", "--stop-timeout", stopTimeout.String())
	if err := os.WriteFile(filepath.Join(mp, "data.bin"), make([]byte, 8<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	sq := startSQLiteLoop(t, filepath.Join(mp, "state.db"))
	pw := startPWriter(t, "sync", filepath.Join(mp, "data.bin"))
	deadline := time.Now().Add(time.Minute)
	for last, _ := pw.state(); sq.count() < 20 || last < 20; last, _ = pw.state() {
		if time.Now().After(deadline) {
			t.Fatalf("the writers made no progress: %d transactions, %d writes\n%s\n%s", sq.count(), last, sq.stderr.String(), pw.stderr.String())
		}
		time.Sleep(10 * time.Millisecond)
	}

	t0 := time.Now()
	d.cmd.Process.Signal(syscall.SIGTERM)
	var took time.Duration
	select {
	case <-d.done:
		took = time.Since(t0)
	case <-time.After(stopTimeout / 2):
		t.Fatalf("the daemon still runs %s after SIGTERM (--stop-timeout %s)\n%s", time.Since(t0).Round(time.Millisecond), stopTimeout, d.stderr)
	}
	if d.code != exitOK {
		t.Fatalf("exit %d after SIGTERM, want 0\n%s", d.code, d.stderr)
	}
	for what, done := range map[string]chan struct{}{"sqlite3": sq.done, "the pwrite writer": pw.done} {
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s still writes after the daemon exited", what)
		}
	}
	last, _ := pw.state()
	t.Logf("exit 0 %s after SIGTERM; %d transactions and %d fsynced writes acknowledged; then sqlite3: %s; the writer: %s",
		took.Round(time.Millisecond), sq.count(), last, strings.TrimSpace(sq.stderr.String()), strings.TrimSpace(pw.stderr.String()))

	dir := unsquashLatest(t, storeDir)
	b := []byte(mustRead(t, filepath.Join(dir, "data.bin")))
	if got := int(binary.LittleEndian.Uint64(b)); got < last || got > last+1 {
		t.Errorf("data.bin: the snapshot holds write %d; write %d was the last one fsynced, and no later write returned before the cut", got, last)
	}
	db := filepath.Join(dir, "state.db")
	os.Remove(db + "-shm")
	integrityOK(t, db)
	rows := map[int]bool{}
	for _, l := range strings.Fields(sqlite(t, db, "SELECT n FROM t;")) {
		n, _ := strconv.Atoi(l)
		rows[n] = true
	}
	sq.mu.Lock()
	defer sq.mu.Unlock()
	for _, n := range sq.acked {
		if !rows[n] {
			t.Fatalf("transaction %d committed, but the published database lacks it (%d rows)", n, len(rows))
		}
	}
}

// taskStates lists the states of pid's threads ("R", "S", "D", "Z"...).
func taskStates(pid int) []string {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
	var out []string
	for _, p := range tasks {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		// "pid (comm) S ...": the state follows the last ')'.
		if i := strings.LastIndexByte(string(b), ')'); i >= 0 && i+2 < len(b) {
			out = append(out, string(b[i+2]))
		}
	}
	return out
}

// TestE2EKill9AtPassthroughBarrier: kill -9 of the daemon while a freeze
// holds the writes of a file written through passthrough (the barrier:
// a chmod of the file through the mount that the daemon holds). The
// daemon's process must end at once, leaving no thread in D state; the
// writer it held must go on and die when killed; and the next `hermesfs
// mount` of the same state dir must come up on its first try.
func TestE2EKill9AtPassthroughBarrier(t *testing.T) {
	need(t, "/dev/fuse", "strace")
	if os.Geteuid() != 0 {
		t.Skip("writable passthrough needs root")
	}
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+e2eDir(t, "store"))
	d := h.mount(mp, "--interval", "0")
	file := filepath.Join(mp, "big.bin")
	if err := os.WriteFile(file, make([]byte, 24<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	w := startPWriter(t, "random", file)
	for _, open := w.state(); !open; _, open = w.state() {
		select {
		case <-w.lines:
		case <-w.done:
			t.Fatalf("writer: %s", w.stderr.String())
		case <-time.After(30 * time.Second):
			t.Fatal("the writer did not open its file")
		}
	}
	if logs := d.stderr.String(); !strings.Contains(logs, "passthrough=true") || strings.Contains(logs, "writes go through the daemon") {
		t.Skipf("no writable passthrough on this kernel:\n%s", tail(logs, 20))
	}
	// The freeze's only sync_file_range (cleanPages) comes after the
	// barriers hold: the kill lands while they do.
	pid := d.cmd.Process.Pid
	cmd := exec.Command("strace", "-f", "-qq", "-o", "/dev/null", "-p", strconv.Itoa(pid),
		"-e", "trace=sync_file_range", "-e", "inject=sync_file_range:signal=KILL")
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	straced := make(chan struct{})
	go func() { cmd.Wait(); close(straced) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-straced })
	for deadline := time.Now().Add(10 * time.Second); ; {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if strings.Contains(string(b), "\nTracerPid:\t") && !strings.Contains(string(b), "\nTracerPid:\t0\n") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("strace did not attach: %s", out.String())
		}
		sleepMillis(10)
	}
	// Whatever goes wrong below, the mount must not stay hung.
	t.Cleanup(func() {
		if fs.IsMountpoint(mp) {
			fs.AbortConnection(mp, slog.Default())
		}
	})
	snap := exec.Command(hermesfsBin(t), "snapshot", mp)
	snap.Env, snap.Dir = h.env(), "/"
	if err := snap.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { snap.Process.Kill(); snap.Wait() })

	select {
	case <-d.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("the daemon did not end 30s after the kill at its barrier: threads %v; the writer's %v", taskStates(pid), taskStates(w.cmd.Process.Pid))
	}
	if d.code != 128+int(syscall.SIGKILL) {
		t.Fatalf("the daemon exited %d, not by the injected SIGKILL (no freeze reached its barrier?)\n%s", d.code, tail(d.stderr.String(), 30))
	}
	// The writer goes on (its writes reach the upper layer directly),
	// and a kill ends it.
	wp := w.cmd.Process.Pid
	for deadline := time.Now().Add(30 * time.Second); ; {
		if s := taskStates(wp); !strings.Contains(strings.Join(s, ""), "D") {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("the writer is stuck in D state 30s after the daemon died: %v", s)
		}
		sleepMillis(10)
	}
	w.cmd.Process.Kill()
	select {
	case <-w.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("the writer ignored SIGKILL: threads %v", taskStates(wp))
	}
	// The next start, first try.
	d2 := h.start(mp, "--interval", "0")
	d2.waitReady()
	if fi, err := os.Stat(file); err != nil || fi.Size() != 24<<20 {
		t.Errorf("big.bin after the restart: %v, %v", fi, err)
	}
	d2.stopOK(t)
}

// TestE2EStopStatusAndSecondSignal: while the store holds the final
// snapshot's upload, `hermesfs status` finds the daemon, running and
// stopping, and says what it does; a second SIGTERM is acknowledged and
// abandons the final snapshot: exit 5 without waiting for the store, the
// change kept in the state dir, and the next start publishes it.
func TestE2EStopStatusAndSecondSignal(t *testing.T) {
	need(t, "/dev/fuse")
	const bucket = "hermes-stop"
	srv := launchS3(t, e2eDir(t, "s3data"), bucket)
	stall := startStallProxy(t, srv.Endpoint)
	mp := e2eDir(t, "home")
	h := newHost(t, fmt.Sprintf("s3://%s/home?endpoint=%s&path_style=true", bucket, stall.URL))
	d := h.mount(mp, "--interval", "0", "--write-back", "0", "--stop-timeout", "5m")
	if err := os.WriteFile(filepath.Join(mp, "a.txt"), []byte("kept for the next start\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	stall.setHold(func(op, path string) bool { return isUpload(op) && strings.Contains(path, "/segments/") })
	var held []*heldRequest
	t.Cleanup(func() {
		stall.setHold(nil)
		for _, r := range held {
			r.release <- false
		}
	})
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case r := <-stall.held:
		held = append(held, r)
	case <-d.done:
		t.Fatalf("exit %d before the final snapshot's upload\n%s", d.code, d.stderr)
	case <-time.After(time.Minute):
		t.Fatalf("the final snapshot's upload did not come within a minute\n%s", d.stderr)
	}

	st, code := h.statusJSON(mp)
	if code != 0 || !st.Running || st.PID != d.cmd.Process.Pid || !strings.HasPrefix(st.Stopping, "final snapshot") || st.StopDeadline.IsZero() {
		t.Errorf("status while the final snapshot uploads: exit %d, running %v, pid %d (the daemon's: %d), stopping %q, gives up at %v; want the daemon, running, in its final snapshot",
			code, st.Running, st.PID, d.cmd.Process.Pid, st.Stopping, st.StopDeadline)
	}
	if code, out, _ := h.run("status", mp); !strings.Contains(out, "stopping (pid ") {
		t.Errorf("status (text) while the daemon stops: exit %d\n%s", code, out)
	}

	d.cmd.Process.Signal(syscall.SIGTERM)
	for deadline := time.Now().Add(30 * time.Second); !strings.Contains(d.stderr.String(), "second signal: stopping now, without the final snapshot"); {
		if time.Now().After(deadline) {
			t.Fatalf("the second SIGTERM was not acknowledged within 30s\n%s", tail(d.stderr.String(), 20))
		}
		sleepMillis(10)
	}
	select {
	case <-d.done:
	case <-time.After(time.Minute):
		t.Fatalf("the daemon still runs a minute after the second signal, its upload still held\n%s", tail(d.stderr.String(), 20))
	}
	if d.code != exitUnsynced {
		t.Fatalf("exit %d after a second signal, want %d\n%s", d.code, exitUnsynced, tail(d.stderr.String(), 20))
	}
	if got := mustRead(t, filepath.Join(h.state, "upper", "a.txt")); got != "kept for the next start\n" {
		t.Errorf("the upper layer after the abandoned stop: a.txt %q", got)
	}

	stall.setHold(nil)
	for _, r := range held {
		r.release <- false
	}
	held = nil
	d2 := h.mount(mp, "--interval", "0", "--write-back", "0")
	if got := mustRead(t, filepath.Join(mp, "a.txt")); got != "kept for the next start\n" {
		t.Errorf("a.txt after the next start: %q", got)
	}
	d2.stopOK(t)
	dir := filepath.Join(e2eDir(t, "restore"), "home")
	if code, _, errs := newHost(t, h.store).run("restore", dir); code != 0 {
		t.Fatalf("restore: exit %d\n%s", code, errs)
	}
	if got := mustRead(t, filepath.Join(dir, "a.txt")); got != "kept for the next start\n" {
		t.Errorf("a.txt in the snapshot the next start published: %q", got)
	}
}
