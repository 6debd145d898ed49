package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// straceKillAt attaches strace to pid so that the when-th of the syscalls
// set naming path kills it with SIGKILL before it happens; it returns once
// strace is attached, with a channel closed when strace has exited.
func straceKillAt(t *testing.T, pid int, path, set string, when int) <-chan struct{} {
	t.Helper()
	cmd := exec.Command("strace", "-f", "-qq", "-o", "/dev/null", "-p", strconv.Itoa(pid), "-P", path,
		"-e", "trace="+set, "-e", fmt.Sprintf("inject=%s:signal=KILL:when=%d", set, when))
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	waitTraced(t, pid, done, &out)
	return done
}

// waitTraced waits until pid has a tracer (strace attached), or strace
// ended.
func waitTraced(t *testing.T, pid int, done <-chan struct{}, out *syncBuffer) {
	t.Helper()
	for i := 0; ; i++ {
		b, err := readProcStatus(pid)
		if err != nil {
			return // gone already
		}
		if strings.Contains(b, "\nTracerPid:\t") && !strings.Contains(b, "\nTracerPid:\t0\n") {
			return
		}
		select {
		case <-done:
			t.Fatalf("strace -p %d: %s", pid, out.String())
		default:
		}
		if i > 1000 {
			t.Fatalf("strace did not attach to %d in 10s: %s", pid, out.String())
		}
		sleepMillis(10)
	}
}

// The points of TestTortureKillCompaction.
var compactPoints = []string{
	"compact-start",  // SIGKILL as the compaction opens its segment file: nothing published
	"compact-latest", // SIGKILL just before the compaction moves LATEST (its segment, extents and manifest are up)
	"compact-adopt",  // SIGKILL after LATEST moved, before the segment is cached and state.json says so
	"compact-prune",  // another host prunes (keeping 1) while compactions publish; then SIGTERM
	"compact-term",   // SIGTERM while a compaction may run: it is cancelled, the stop does not wait
}

// TestTortureKillCompaction kills the daemon at each step of a background
// compaction (every snapshot is compacted: --compact extents=1), with the
// workload of TestTortureKillAnywhere running, and lets another host prune
// while compactions publish. After each kill the restart must show every
// acknowledged op; every published snapshot, compactions included, must
// be the tree at one instant; LATEST always names a complete snapshot; a
// new host sees the last state at the end.
func TestTortureKillCompaction(t *testing.T) {
	need(t, "/dev/fuse", "sqlite3", "unsquashfs", "strace", "chattr")
	seed := tortureSeed(t)
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	r := newTortureRig(t, seed, store, "--interval", "0", "--write-back", "0", "--keep", "1000", "--compact", "extents=1", "--stop-timeout", "30s")
	rounds := tortureRounds(len(compactPoints))
	compactions := 0
	// A first session stopped cleanly: its final snapshot becomes the
	// base, and the snapshots after extend it (on an empty lower layer
	// every image is laid out afresh, and none is compacted).
	d := r.boot()
	w := r.startWorkload()
	r.waitProgress(50, w)
	w.stop(t)
	if code := d.stop(syscall.SIGTERM); code != exitOK {
		t.Fatalf("first stop: exit %d\n%s", code, tail(d.stderr.String(), 40))
	}
	r.m.readJournal(t)
	for i := range rounds {
		point := compactPoints[i%len(compactPoints)]
		r.stats.rounds++
		d := r.boot()
		r.verifySnapshots()
		w := r.startWorkload()
		r.waitProgress(20+r.rng.IntN(100), w)
		pid := d.cmd.Process.Pid
		t.Logf("round %d: %s (journal line %d)", i, point, r.m.lines)
		// Nothing else moves LATEST: a recovered change's snapshot and
		// its compaction are done before the strace goes on.
		r.waitIdle(d)
		var sc <-chan struct{}
		rename := "rename,renameat,renameat2"
		switch point {
		case "compact-start":
			sc = straceKillAt(t, pid, filepath.Join(r.h.state, "pack", "compact.seg"), "open,openat", 1)
		case "compact-latest":
			// The snapshot moves LATEST first, its compaction second.
			sc = straceKillAt(t, pid, filepath.Join(storeDir, "LATEST"), rename, 2)
		case "compact-adopt":
			sc = straceKillAt(t, pid, filepath.Join(r.h.state, "pack", "compact.seg"), rename, 1)
		}
		code, out, errOut := r.h.run("snapshot", r.mp)
		if code != 0 && sc == nil {
			t.Fatalf("round %d: snapshot: exit %d %s%s\n%s", i, code, out, errOut, tail(d.stderr.String(), 40))
		}
		switch point {
		case "compact-prune":
			other := newHost(t, store)
			for k := 0; k < 3; k++ {
				if code, out, errOut := other.run("prune", "--keep-last", "1"); code != 0 {
					t.Fatalf("round %d: prune racing a compaction: exit %d %s%s", i, code, out, errOut)
				}
				if k < 2 {
					r.h.run("snapshot", r.mp)
				}
			}
			d.cmd.Process.Signal(syscall.SIGTERM)
			r.stats.sigterms++
		case "compact-term":
			sleepMillis(r.rng.IntN(200))
			d.cmd.Process.Signal(syscall.SIGTERM)
			r.stats.sigterms++
		default:
			select {
			case <-d.done:
			case <-time.After(60 * time.Second):
				d.cmd.Process.Signal(syscall.SIGTERM) // the point was not reached
				r.stats.sigterms++
			}
		}
		d.wait()
		if sc != nil {
			<-sc
			if d.code == 128+int(syscall.SIGKILL) {
				r.stats.pointKills++
			} else {
				r.stats.pointMissed++
				t.Logf("round %d: %s: the point was not reached (exit %d)", i, point, d.code)
			}
		}
		compactions += strings.Count(d.stderr.String(), "compacted snapshot published")
		code = r.ended(d)
		w.wait(t)
		r.m.readJournal(t)
		if code == exitOK {
			r.latestHasEverything(fmt.Sprintf("round %d (%s): exit 0", i, point))
		}
		r.detach()
	}
	r.finish()
	if compactions == 0 {
		t.Error("no compaction was published in any round")
	}
	t.Logf("%d rounds: %d SIGKILLs at chosen points (%d not reached), %d SIGTERMs (exit 0: %d, exit 5: %d), %d compactions published, %d snapshots verified (%d pruned meanwhile), %d ops acknowledged",
		r.stats.rounds, r.stats.pointKills, r.stats.pointMissed, r.stats.sigterms, r.stats.exit0, r.stats.exit5, compactions, r.stats.snapshots, r.stats.pruned, r.m.acked)
}

// waitIdle waits until the daemon runs no snapshot and no compaction.
func (r *tortureRig) waitIdle(d *daemonProc) {
	t := r.t
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		st, _ := r.h.statusJSON(r.mp)
		if !st.InProgress && (st.Compaction == nil || !st.Compaction.Running) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the daemon was still busy after 90s:\n%s", tail(d.stderr.String(), 40))
		}
		sleepMillis(50)
	}
}

func readProcStatus(pid int) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	return string(b), err
}
