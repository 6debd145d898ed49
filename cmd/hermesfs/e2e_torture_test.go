package main

// Crash and fault torture of the real `hermesfs mount` daemon: the product
// promise is that nothing acknowledged (a write whose fsync, or rename and
// directory fsync, returned) is ever lost, whatever happens to the daemon
// and the store, and that every published snapshot is the tree at one
// instant. The workload and the checker are in e2e_torture_model_test.go.
//
// Every run logs its seed; HERMESFS_TORTURE_SEED=N replays one, and
// HERMESFS_TORTURE_ROUNDS=N runs more (or fewer) kill rounds.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/testwatch"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

func sleepMillis(n int) { time.Sleep(time.Duration(n) * time.Millisecond) }

// tortureSeed is the run's seed: $HERMESFS_TORTURE_SEED or the clock.
func tortureSeed(t *testing.T) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("HERMESFS_TORTURE_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("HERMESFS_TORTURE_SEED=%q: %v", s, err)
		}
		seed = n
	}
	t.Logf("seed %d (replay with HERMESFS_TORTURE_SEED=%d)", seed, seed)
	return seed
}

func tortureRounds(def int) int {
	if n, err := strconv.Atoi(os.Getenv("HERMESFS_TORTURE_ROUNDS")); err == nil && n > 0 {
		return n
	}
	return def
}

// immutableDir makes dir (empty, soon a mountpoint) immutable, so a path
// used after the mount went away can never write into the directory under
// it: the workload's ops then fail instead of "succeeding" off the mount.
func immutableDir(t *testing.T, dir string) {
	t.Helper()
	if out, err := exec.Command("chattr", "+i", dir).CombinedOutput(); err != nil {
		t.Fatalf("chattr +i %s: %v %s", dir, err, out)
	}
	t.Cleanup(func() { exec.Command("chattr", "-i", dir).Run() })
}

// tortureStats are what a run did, for its log.
type tortureStats struct {
	rounds, kills, pointKills, pointMissed, sigterms, exit0, exit5 int
	snapshots, pruned, restarts, deadMountRestarts                 int
	partialsDone                                                   int // partial copy-ups completed
}

// tortureRig is one home being tortured: a host (state dir), a mountpoint,
// a journal and its model, and a direct view of the store.
type tortureRig struct {
	t        *testing.T
	seed     uint64
	rng      *rand.Rand
	h        *host
	mp       string
	storeDir string // local stores only
	args     []string
	workers  []string
	m        *tortureModel
	cat      *uploader.Catalog
	verified map[string]cutSet
	order    []string // verified snapshot ids, oldest first
	stats    tortureStats
	pause    string // the workload's pause file
	pace     int    // milliseconds before each op of each worker (0: none)
}

func newTortureRig(t *testing.T, seed uint64, store string, args ...string) *tortureRig {
	t.Helper()
	// Minutes of kill rounds or store outages: longer than other tests
	// may take before testwatch calls them hung.
	testwatch.Extend(t, 20*time.Minute)
	mp := filepath.Join(e2eDir(t, "home"), "h")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	immutableDir(t, mp)
	s, _, err := storeurl.Open(t.Context(), store, storeurl.Options{UID: os.Getuid()})
	if err != nil {
		t.Fatal(err)
	}
	jdir := e2eDir(t, "journal")
	r := &tortureRig{
		t: t, seed: seed, rng: rand.New(rand.NewPCG(seed, 42)),
		h: newHost(t, store), mp: mp, args: args,
		workers:  []string{"files", "blob", "sql"},
		m:        newTortureModel(seed, filepath.Join(jdir, "journal")),
		cat:      uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"}),
		verified: map[string]cutSet{},
		pause:    filepath.Join(jdir, "pause"),
	}
	// Files from the archive of 64 KiB and more (blob.bin, state.db
	// once it grew) are copied up by range, so kills land in partial
	// copy-ups and their background completion too.
	r.h.extraEnv = append(r.h.extraEnv, "HERMESFS_COPY_UP_BY_RANGE_MIN=64K")
	if strings.HasPrefix(store, "file://") {
		r.storeDir = strings.TrimPrefix(store, "file://")
	}
	return r
}

// workloadProc is a running workload.
type workloadProc struct {
	cmd    *exec.Cmd
	stderr *syncBuffer
	done   chan struct{}
}

func (r *tortureRig) startWorkload() *workloadProc {
	t := r.t
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := json.Marshal(workloadConfig{Mount: r.mp, Journal: r.m.journal, Seed: r.seed, Seq: max(r.m.nextSeq, 1), Workers: r.workers, PauseFile: r.pause, PaceMillis: r.pace})
	w := &workloadProc{cmd: exec.Command(self), stderr: &syncBuffer{}, done: make(chan struct{})}
	w.cmd.Env = append(os.Environ(), workloadEnv+"="+string(cfg))
	w.cmd.Dir = "/"
	w.cmd.Stderr = w.stderr
	if err := w.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { w.cmd.Wait(); close(w.done) }()
	t.Cleanup(func() { w.cmd.Process.Kill(); <-w.done })
	return w
}

// stop asks the workload to finish its ops in flight and waits for it.
func (w *workloadProc) stop(t *testing.T) {
	t.Helper()
	w.cmd.Process.Signal(syscall.SIGTERM)
	w.wait(t)
}

func (w *workloadProc) wait(t *testing.T) {
	t.Helper()
	select {
	case <-w.done:
	case <-time.After(60 * time.Second):
		w.cmd.Process.Kill()
		t.Fatalf("the workload did not stop within 60s:\n%s", w.stderr)
	}
}

// acks is how many ops the workload acknowledged so far, in all.
func (r *tortureRig) acks() int {
	b, _ := os.ReadFile(r.m.journal)
	return bytes.Count(b, []byte("\nA ")) + bytes.Count(b[:min(len(b), 2)], []byte("A "))
}

// waitProgress waits until the workload acknowledged n more ops.
func (r *tortureRig) waitProgress(n int, w *workloadProc) {
	r.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	n += r.acks()
	for r.acks() < n {
		select {
		case <-w.done:
			r.t.Fatalf("the workload ended early:\n%s", w.stderr)
		default:
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("the workload made no progress (%d of %d ops) in 60s:\n%s", r.acks(), n, w.stderr)
		}
		sleepMillis(10)
	}
}

// boot starts the daemon on the rig's state dir and checks, against the
// journal, that the mount shows every acknowledged op.
func (r *tortureRig) boot() *daemonProc {
	t := r.t
	t.Helper()
	d := r.h.start(r.mp, r.args...)
	d.waitReady()
	r.stats.restarts++
	r.m.readJournal(t)
	r.m.resolve(t, readTree(t, r.mp))
	return d
}

// ended records how the daemon ended and checks the state dir it left.
func (r *tortureRig) ended(d *daemonProc) int {
	t := r.t
	t.Helper()
	code := d.wait()
	r.stats.partialsDone += strings.Count(d.stderr.String(), "partial copy-up complete")
	switch code {
	case 128 + int(syscall.SIGKILL):
		r.stats.kills++
	case exitOK:
		r.stats.exit0++
	case exitUnsynced:
		r.stats.exit5++
	default:
		t.Fatalf("daemon exit %d:\n%s", code, tail(d.stderr.String(), 60))
	}
	if _, err := daemon.ReadState(r.h.state); err != nil {
		t.Fatalf("state.json after the daemon ended (exit %d): %v", code, err)
	}
	return code
}

// detach removes the dead mount a killed daemon left: by `hermesfs
// umount` mostly, but sometimes it is left for the next start to handle.
func (r *tortureRig) detach() {
	t := r.t
	t.Helper()
	if !fs.IsMountpoint(r.mp) {
		return
	}
	if r.rng.IntN(3) == 0 {
		r.stats.deadMountRestarts++
		return
	}
	code, out, errOut := r.h.run("umount", r.mp)
	if code != 0 || !strings.Contains(out, "detached") {
		t.Fatalf("umount of a dead mount: exit %d %q %s", code, out, errOut)
	}
}

// verifySnapshots checks every snapshot published since the last call:
// its manifest and archive agree (size, sha256), unsquashfs extracts it,
// its database passes integrity_check, and the tree is the workload's
// state at one cut of the journal. Snapshots are then ordered: a newer
// one never shows an older state than the one before it. LATEST always
// names a complete snapshot.
func (r *tortureRig) verifySnapshots() {
	t := r.t
	t.Helper()
	snaps, err := r.cat.Snapshots(t.Context())
	if err != nil {
		t.Fatalf("list snapshots: %v", err)
	}
	// Read the journal after listing: every op a listed snapshot holds had
	// its B line written before the snapshot's freeze.
	r.m.readJournal(t)
	slices.Reverse(snaps) // oldest first
	for _, s := range snaps {
		if s.Latest && (s.Incomplete || s.Err != nil) {
			t.Fatalf("LATEST names %s, which is incomplete (%v)", s.ID, s.Err)
		}
		if s.Incomplete {
			continue // an upload a crash cut short: never published
		}
		if s.Err != nil {
			// A manifest listed and then gone was pruned meanwhile (a
			// compaction takes the place of what it compacts, whatever
			// --keep says): a prune deletes the manifest first.
			if _, err := r.cat.Manifest(t.Context(), s.ID); errors.Is(s.Err, iofs.ErrNotExist) && errors.Is(err, iofs.ErrNotExist) {
				r.stats.pruned++
				continue
			}
			t.Fatalf("snapshot %s: %v", s.ID, s.Err)
		}
		if _, ok := r.verified[s.ID]; ok {
			continue
		}
		cuts, ok := r.checkSnapshot(s.ID)
		if !ok {
			r.stats.pruned++
			continue
		}
		r.verified[s.ID] = cuts
		r.order = append(r.order, s.ID)
		r.stats.snapshots++
	}
	// Newer snapshots never go back in time.
	slices.Sort(r.order)
	for i := 1; i < len(r.order); i++ {
		prev, cur := r.verified[r.order[i-1]], r.verified[r.order[i]]
		if len(prev) > 0 && len(cur) > 0 && cur[len(cur)-1][1] < prev[0][0] {
			t.Errorf("snapshot %s shows an older state (cuts %v) than the snapshot before it, %s (cuts %v)", r.order[i], cur, r.order[i-1], prev)
		}
	}
}

// checkSnapshot restores snapshot id as any client would and returns the
// journal cuts that explain it; false if retention deleted it meanwhile.
func (r *tortureRig) checkSnapshot(id string) (cutSet, bool) {
	t := r.t
	t.Helper()
	dir := e2eDir(t, "snap")
	defer os.RemoveAll(dir)
	archive := filepath.Join(dir, "a.sqfs")
	if _, err := r.cat.Restore(t.Context(), archive, uploader.RestoreOptions{ID: id, Image: image.Opener(r.cat.Store(), r.cat.Identities(), "")}); err != nil {
		latest, _ := r.cat.LatestID(t.Context())
		_, merr := r.cat.Manifest(t.Context(), id)
		if errors.Is(merr, iofs.ErrNotExist) && id != latest {
			return nil, false // pruned since the listing
		}
		t.Fatalf("snapshot %s does not verify against its manifest: %v", id, err)
	}
	out := filepath.Join(dir, "root")
	if b, err := exec.Command("unsquashfs", "-no-progress", "-q", "-d", out, archive).CombinedOutput(); err != nil {
		t.Fatalf("unsquashfs %s: %v\n%s", id, err, b)
	}
	s := readTree(t, out)
	if len(s.extra) > 0 {
		t.Fatalf("snapshot %s holds entries the workload never made: %v", id, s.extra)
	}
	all, per := r.m.explain(s)
	if len(all) == 0 {
		t.Fatalf("SNAPSHOT %s IS NOT THE TREE AT ANY ONE INSTANT: per worker it fits cuts %v (journal lines 0..%d)\ncompared with the current state:\n%s",
			id, per, r.m.lines-1, r.m.describe(s))
	}
	return all, true
}

// latestHasEverything checks that LATEST holds every acknowledged op: what
// an exit status 0 promises.
func (r *tortureRig) latestHasEverything(why string) {
	t := r.t
	t.Helper()
	id, err := r.cat.LatestID(t.Context())
	if err != nil || id == "" {
		t.Fatalf("%s: LATEST: %q %v", why, id, err)
	}
	r.verifySnapshots()
	cuts, ok := r.verified[id]
	if !ok {
		t.Fatalf("%s: LATEST %s was not verified", why, id)
	}
	if !cuts.contains(endCut) {
		t.Errorf("%s: LATEST %s fits cuts %v only, but acknowledged ops go up to line %d: ACKNOWLEDGED WRITES ARE NOT IN THE STORE",
			why, id, cuts, r.m.lines-1)
	}
}

// straceKill attaches strace to pid so that the first rename naming path
// kills it with SIGKILL before the rename happens, and returns once strace
// is attached, with a channel closed when strace has exited.
func straceKill(t *testing.T, pid int, path string) <-chan struct{} {
	t.Helper()
	set := "rename,renameat,renameat2"
	cmd := exec.Command("strace", "-f", "-qq", "-o", "/dev/null", "-p", strconv.Itoa(pid), "-P", path,
		"-e", "trace="+set, "-e", "inject="+set+":signal=KILL")
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() { cmd.Process.Kill(); <-done })
	for i := 0; ; i++ {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			return done // gone already
		}
		if strings.Contains(string(b), "\nTracerPid:\t") && !strings.Contains(string(b), "\nTracerPid:\t0\n") {
			return done
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

func tail(s string, lines int) string {
	l := strings.Split(s, "\n")
	if len(l) > lines {
		l = l[len(l)-lines:]
	}
	return strings.Join(l, "\n")
}

// The kill modes of TestTortureKillAnywhere.
var killModes = []string{
	"kill",          // SIGKILL at a random instant
	"term-kill",     // SIGTERM, then SIGKILL during the final snapshot
	"term",          // SIGTERM while the workload writes: exit 0 only if all of it is published
	"term-quiet",    // workload stopped, SIGTERM: exit 0, rebased
	"point-pack",    // SIGKILL at the end of a pack (rename of pack/next.seg)
	"point-latest",  // SIGKILL just before LATEST moves (segment, extents and manifest are up)
	"point-state",   // SIGKILL after LATEST moved, before state.json says so
	"point-rebase",  // SIGKILL at the rebase after the final snapshot (upper set aside)
	"kill-snapshot", // SIGKILL while a snapshot is in progress
}

// TestTortureKillAnywhere kills the daemon at random instants and at chosen
// points of the snapshot path, with write-back publishing a second after
// each change (and an interval tick every 5s) and a workload
// of fsynced files, in-place rewrites and SQLite transactions running, and
// restarts it on the same state dir each time: every acknowledged op must
// be in the mount, every published snapshot must be the tree at one
// instant, and at the end a new host sees exactly the last state.
func TestTortureKillAnywhere(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs", "strace", "chattr")
	seed := tortureSeed(t)
	storeDir := e2eDir(t, "store")
	r := newTortureRig(t, seed, "file://"+storeDir, "--interval", "5s", "--write-back", "1s", "--keep", "1000", "--stop-timeout", "30s")
	rounds := tortureRounds(len(killModes) + 3)
	modes := slices.Clone(killModes)
	r.rng.Shuffle(len(modes), func(i, j int) { modes[i], modes[j] = modes[j], modes[i] })
	for i := range rounds {
		mode := modes[i%len(modes)]
		if i >= len(modes) {
			mode = killModes[r.rng.IntN(len(killModes))]
		}
		r.killRound(i, mode)
	}
	r.finish()
	t.Logf("%d rounds: %d SIGKILLs (%d at chosen points, %d points not reached), %d SIGTERMs (exit 0: %d, exit 5: %d), %d restarts (%d over a dead mount), %d snapshots verified, %d ops acknowledged; ops in flight at a crash: %d done, %d partial, %d never happened; %d partial copy-ups completed",
		r.stats.rounds, r.stats.kills, r.stats.pointKills, r.stats.pointMissed, r.stats.sigterms, r.stats.exit0, r.stats.exit5,
		r.stats.restarts, r.stats.deadMountRestarts, r.stats.snapshots, r.m.acked, r.m.resolvedFull, r.m.resolvedPartial, r.m.resolvedVoid, r.stats.partialsDone)
}

func (r *tortureRig) killRound(i int, mode string) {
	t := r.t
	t.Helper()
	r.stats.rounds++
	d := r.boot()
	r.verifySnapshots()
	w := r.startWorkload()
	r.waitProgress(20+r.rng.IntN(150), w)
	pid := d.cmd.Process.Pid
	t.Logf("round %d: %s (journal line %d)", i, mode, r.m.lines)
	point := func(path string) {
		sc := straceKill(t, pid, path)
		select {
		case <-d.done:
		case <-time.After(8 * time.Second):
			// Not reached by a periodic snapshot: the final one will.
			d.cmd.Process.Signal(syscall.SIGTERM)
			r.stats.sigterms++
		}
		d.wait()
		<-sc
		if d.code == 128+int(syscall.SIGKILL) {
			r.stats.pointKills++
		} else {
			r.stats.pointMissed++
			t.Logf("round %d: %s: the point was not reached (exit %d)", i, mode, d.code)
		}
	}
	switch mode {
	case "kill":
		sleepMillis(r.rng.IntN(2500))
		d.cmd.Process.Kill()
	case "term-kill":
		sleepMillis(r.rng.IntN(1500))
		d.cmd.Process.Signal(syscall.SIGTERM)
		r.stats.sigterms++
		sleepMillis(r.rng.IntN(1500))
		d.cmd.Process.Kill()
	case "term", "term-quiet":
		sleepMillis(r.rng.IntN(2000))
		if mode == "term-quiet" {
			w.stop(t)
		}
		d.cmd.Process.Signal(syscall.SIGTERM)
		r.stats.sigterms++
	case "point-pack":
		point(filepath.Join(r.h.state, "pack", "next.seg"))
	case "point-latest":
		point(filepath.Join(r.storeDir, "LATEST"))
	case "point-state":
		point(filepath.Join(r.h.state, "state.json"))
	case "point-rebase":
		w.stop(t)
		sc := straceKill(t, pid, filepath.Join(r.h.state, "upper"))
		d.cmd.Process.Signal(syscall.SIGTERM)
		r.stats.sigterms++
		d.wait()
		<-sc
		if d.code == 128+int(syscall.SIGKILL) {
			r.stats.pointKills++
		} else {
			r.stats.pointMissed++
			t.Logf("round %d: rebase point not reached (exit %d)", i, d.code)
		}
	case "kill-snapshot":
		deadline := time.Now().Add(20 * time.Second)
		for time.Now().Before(deadline) {
			if st, _ := r.h.statusJSON(r.mp); st.InProgress {
				break
			}
		}
		sleepMillis(r.rng.IntN(200))
		d.cmd.Process.Kill()
	}
	code := r.ended(d)
	w.wait(t)
	r.m.readJournal(t)
	if code == exitOK {
		// Exit 0 promises the store has every acknowledged write.
		r.latestHasEverything(fmt.Sprintf("round %d (%s): exit 0", i, mode))
		st, _ := daemon.ReadState(r.h.state)
		if mode == "term-quiet" && (st.Unpublished || !st.CleanShutdown || st.Base != st.LastPublished) {
			t.Errorf("round %d: a clean stop with nothing written after the final snapshot should rebase: %+v", i, st)
		}
	}
	if code == exitUnsynced {
		if st, _ := daemon.ReadState(r.h.state); !st.Unpublished {
			t.Errorf("round %d: exit 5 but state.json does not record unpublished changes: %+v", i, st)
		}
	}
	r.detach()
}

// finish restarts once more, stops cleanly with the workload stopped, and
// mounts the store on a new host: it must show exactly the last state.
func (r *tortureRig) finish() {
	t := r.t
	t.Helper()
	d := r.boot()
	r.verifySnapshots()
	if code := d.stop(syscall.SIGTERM); code != exitOK {
		t.Fatalf("final stop: exit %d\n%s", code, tail(d.stderr.String(), 60))
	}
	r.latestHasEverything("final stop")
	mp := filepath.Join(e2eDir(t, "newhost"), "h")
	os.Mkdir(mp, 0o755)
	b := newHost(t, r.h.store)
	db := b.mount(mp, "--interval", "0")
	s := readTree(t, mp)
	if all, _ := r.m.explain(s); !all.contains(endCut) {
		t.Errorf("a new host does not see the last state:\n%s", r.m.describe(s))
	}
	if code := db.stop(syscall.SIGTERM); code != exitOK {
		t.Errorf("new host stop: exit %d\n%s", code, tail(db.stderr.String(), 40))
	}
}

// ---- S3 through a fault proxy and a stall proxy ----

// stallProxy sits in front of an S3 endpoint and can hold chosen requests:
// the test then drops them (the client sees a reset) or lets them through
// later, even after the client has gone (a request that lands after the
// process that sent it died).
type stallProxy struct {
	URL    string
	target string
	srv    *http.Server
	client *http.Client

	mu   sync.Mutex
	hold func(op, path string) bool
	// holdRange chooses by the Range header too.
	holdRange func(op, path, rng string) bool
	held      chan *heldRequest
	n         int // requests seen
}

// heldRequest is one held request; send true on release to forward it,
// false to drop it; done is closed once it was.
type heldRequest struct {
	Op, Path string
	release  chan bool
	done     chan struct{}
}

// settle waits until the released request was forwarded (its response
// back from the store) or dropped.
func (h *heldRequest) settle(t *testing.T) {
	t.Helper()
	select {
	case <-h.done:
	case <-time.After(90 * time.Second):
		t.Fatalf("the released %s %s did not complete in 90s", h.Op, h.Path)
	}
}

func startStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallProxy{
		URL: "http://" + ln.Addr().String(), target: strings.TrimSuffix(target, "/"),
		client: &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		held:   make(chan *heldRequest, 64),
	}
	p.srv = &http.Server{Handler: p}
	go p.srv.Serve(ln)
	t.Cleanup(func() {
		p.setHold(nil)
		p.setHoldRange(nil)
		p.srv.Close()
		p.client.CloseIdleConnections()
	})
	return p
}

// setHold makes the proxy hold the requests f chooses (nil: none).
func (p *stallProxy) setHold(f func(op, path string) bool) {
	p.mu.Lock()
	p.hold = f
	p.mu.Unlock()
}

// setHoldRange makes the proxy hold the requests f chooses by operation,
// path and Range header (nil: none).
func (p *stallProxy) setHoldRange(f func(op, path, rng string) bool) {
	p.mu.Lock()
	p.holdRange = f
	p.mu.Unlock()
}

func (p *stallProxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return
	}
	op := faultproxy.Op(r)
	p.mu.Lock()
	p.n++
	hold := p.hold != nil && p.hold(op, r.URL.Path) || p.holdRange != nil && p.holdRange(op, r.URL.Path, r.Header.Get("Range"))
	p.mu.Unlock()
	if hold {
		h := &heldRequest{Op: op, Path: r.URL.Path, release: make(chan bool, 1), done: make(chan struct{})}
		defer close(h.done)
		p.held <- h
		if !<-h.release {
			hangUp(w)
			return
		}
	}
	// Forwarded on a context of its own: a held request lands even if its
	// client is gone.
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := http.NewRequestWithContext(ctx, r.Method, p.target+r.URL.RequestURI(), bytes.NewReader(body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	out.Header = r.Header.Clone()
	out.Host = r.Host
	out.ContentLength = int64(len(body))
	resp, err := p.client.Do(out)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
}

func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetLinger(0)
	}
	conn.Close()
}

// s3Rig is a versitygw with a fault proxy in front and, per host, a stall
// proxy in front of that.
type s3Rig struct {
	srv    *s3test.Server
	data   string
	faults *faultproxy.Proxy
	bucket string
}

func startS3Rig(t *testing.T) *s3Rig {
	t.Helper()
	const bucket = "hermes-torture"
	data := e2eDir(t, "s3data")
	srv := launchS3(t, data, bucket)
	fp, err := faultproxy.Start(srv.Endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fp.Close() })
	return &s3Rig{srv: srv, data: data, faults: fp, bucket: bucket}
}

// url is the store URL of prefix through endpoint.
func (s *s3Rig) url(endpoint, prefix string) string {
	return fmt.Sprintf("s3://%s/%s?endpoint=%s&path_style=true", s.bucket, prefix, endpoint)
}

// direct is the store URL straight to the server (for checks).
func (s *s3Rig) direct(prefix string) string { return s.url(s.srv.Endpoint, prefix) }

// isUpload tells the requests that write an object (single or
// multipart) from the rest.
func isUpload(op string) bool {
	return op == "PutObject" || op == "UploadPart" || op == "CreateMultipartUpload" || op == "CompleteMultipartUpload"
}

// TestTortureKillDuringUpload kills the daemon while the store holds its
// requests, at every step of a publish: mid-upload of the new segment, of
// its digests, of the extents list, of the manifest, and with the LATEST
// update in flight, which then either never arrives or lands after the
// daemon died. Rare 500s, 503s and resets come on top all along. After
// each kill nothing acknowledged is lost (the restart shows it all, the
// final snapshot holds it all), and every manifest in the store names
// only objects the store holds: a crash leaves at worst objects no
// manifest names.
func TestTortureKillDuringUpload(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs", "chattr")
	seed := tortureSeed(t)
	s3 := startS3Rig(t)
	stall := startStallProxy(t, s3.faults.URL)
	s3.faults.SetRule(faultproxy.Every(17, faultproxy.Error500, faultproxy.SlowDown, faultproxy.Reset, faultproxy.ErrorAfter, faultproxy.ResetAfter))
	r := newTortureRig(t, seed, s3.url(stall.URL, "home"), "--interval", "1s", "--keep", "1000", "--stop-timeout", "30s")
	r.cat = storeCatalog(t, s3.direct("home"))
	upload := func(suffix string) func(op, path string) bool {
		return func(op, path string) bool { return isUpload(op) && strings.HasSuffix(path, suffix) }
	}
	modes := []struct {
		name  string
		match func(op, path string) bool
		land  bool // forward the held request after the kill
	}{
		{"segment upload", func(op, path string) bool {
			return isUpload(op) && strings.Contains(path, "/segments/") && uploader.IsSegmentKey(path[strings.Index(path, "/segments/")+1:])
		}, false},
		{"digests upload", func(op, path string) bool {
			return isUpload(op) && strings.Contains(path, "/segments/") && strings.HasSuffix(path, uploader.SumsExt)
		}, false},
		{"extents upload", upload(uploader.ExtentsExt), false},
		{"manifest upload", func(op, path string) bool {
			return isUpload(op) && strings.HasSuffix(path, uploader.ManifestExt) && strings.Contains(path, "/snapshots/")
		}, false},
		{"manifest lands after the crash", func(op, path string) bool {
			return isUpload(op) && strings.HasSuffix(path, uploader.ManifestExt) && strings.Contains(path, "/snapshots/")
		}, true},
		{"LATEST lost", upload("/LATEST"), false},
		{"LATEST lands after the crash", upload("/LATEST"), true},
		{"lease renewal", upload("/lease"), true},
	}
	rounds := tortureRounds(len(modes) + 1)
	for i := range rounds {
		mode := modes[i%len(modes)]
		r.stats.rounds++
		d := r.boot()
		r.verifySnapshots()
		w := r.startWorkload()
		r.waitProgress(20+r.rng.IntN(100), w)
		t.Logf("round %d: kill with %s held (journal line %d)", i, mode.name, r.m.lines)
		stall.setHold(mode.match)
		var h *heldRequest
		select {
		case h = <-stall.held:
		case <-time.After(40 * time.Second):
			t.Fatalf("round %d: no %s request within 40s:\n%s", i, mode.name, tail(d.stderr.String(), 40))
		}
		stall.setHold(nil)
		sleepMillis(r.rng.IntN(300))
		d.cmd.Process.Kill()
		r.ended(d)
		h.release <- mode.land
		settle := []*heldRequest{h}
		// Whatever else was held behind it goes through or away.
		for drained := false; !drained; {
			select {
			case o := <-stall.held:
				o.release <- mode.land
				settle = append(settle, o)
			default:
				drained = true
			}
		}
		for _, o := range settle {
			o.settle(t)
		}
		w.wait(t)
		r.m.readJournal(t)
		// What the crash left, with what was let through landed.
		checkStoreRefs(t, r.cat)
		r.detach()
	}
	r.finish()
	checkStoreRefs(t, r.cat)
	ops, faults := s3.faults.Counts()
	t.Logf("%d rounds, %d SIGKILLs with a request held, %d restarts (%d over a dead mount), %d snapshots verified, %d ops acknowledged (in flight at a crash: %d done, %d partial, %d void); S3 requests %v, faults injected %v",
		r.stats.rounds, r.stats.kills, r.stats.restarts, r.stats.deadMountRestarts, r.stats.snapshots, r.m.acked,
		r.m.resolvedFull, r.m.resolvedPartial, r.m.resolvedVoid, ops, faults)
}

// storeCatalog opens a catalog on store for checks.
func storeCatalog(t *testing.T, store string) *uploader.Catalog {
	t.Helper()
	s, _, err := storeurl.Open(t.Context(), store, storeurl.Options{UID: os.Getuid()})
	if err != nil {
		t.Fatal(err)
	}
	return uploader.NewCatalog(s, uploader.CatalogOptions{Host: "checker"})
}

// A daemon killed before its first snapshot leaves a dead mount over an
// empty store; the next start (what systemd's Restart=on-failure does)
// must detach it and come up with the local changes, without anyone
// running `hermesfs umount` first.
func TestTortureRestartOverDeadMount(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "chattr")
	storeDir := e2eDir(t, "store")
	mp := filepath.Join(e2eDir(t, "home"), "h")
	os.Mkdir(mp, 0o755)
	immutableDir(t, mp)
	h := newHost(t, "file://"+storeDir)
	for round := range 3 {
		d := h.mount(mp, "--interval", "0")
		for i := range round {
			if got := mustRead(t, filepath.Join(mp, fmt.Sprintf("f%d", i))); got != fmt.Sprint(i) {
				t.Fatalf("round %d: f%d = %q after a restart over the dead mount", round, i, got)
			}
		}
		p := filepath.Join(mp, fmt.Sprintf("f%d", round))
		if err := writeSynced(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, []byte(fmt.Sprint(round))); err != nil {
			t.Fatal(err)
		}
		d.cmd.Process.Kill()
		d.wait()
		if !fs.IsMountpoint(mp) || daemon.ProbeFUSE(mp, time.Minute) != daemon.FUSEDead {
			t.Fatalf("round %d: expected a dead mount after kill -9", round)
		}
	}
	d := h.mount(mp, "--interval", "0")
	for i := range 3 {
		if got := mustRead(t, filepath.Join(mp, fmt.Sprintf("f%d", i))); got != fmt.Sprint(i) {
			t.Errorf("f%d = %q", i, got)
		}
	}
	if !strings.Contains(d.stderr.String(), "detached the dead mount") {
		t.Errorf("the start should say it detached a dead mount:\n%s", d.stderr)
	}
	if code := d.stop(syscall.SIGTERM); code != exitOK {
		t.Fatalf("stop: exit %d\n%s", code, d.stderr)
	}
}

// waitPublished waits until a published snapshot holds every op
// acknowledged before journal line line, checking each new snapshot on
// the way.
func (r *tortureRig) waitPublished(d *daemonProc, line int, within time.Duration) {
	t := r.t
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		r.verifySnapshots()
		for _, c := range r.verified {
			if len(c) > 0 && c[len(c)-1][1] >= line-1 {
				return
			}
		}
		if time.Now().After(deadline) {
			st, _ := r.h.statusJSON(r.mp)
			t.Fatalf("the store is back, but nothing acknowledged before journal line %d was published within %s: lease %q, last error %q\n%s",
				line, within, st.Lease, st.LastError, tail(d.stderr.String(), 40))
		}
		sleepMillis(200)
	}
}

// TestTortureStoreOutage runs the workload against the S3 store through
// periods of 500s, 503s, resets, an outage longer than the writer lease
// and a black hole: local I/O goes on (the workload keeps acknowledging
// ops while nothing reaches the store), status shows the error, LATEST
// never moves to anything partial, and once the store is back everything
// is published. Snapshots come from write-back (the interval is long):
// its retries with backoff are what publish once the store is back. Finally SIGTERM during an outage exits 5 with the upper
// layer kept, and the next start publishes it.
func TestTortureStoreOutage(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs", "chattr")
	seed := tortureSeed(t)
	s3 := startS3Rig(t)
	stall := startStallProxy(t, s3.faults.URL)
	r := newTortureRig(t, seed, s3.url(stall.URL, "home"), "--interval", "10m", "--write-back", "1s", "--keep", "1000", "--stop-timeout", "20s")
	r.cat = storeCatalog(t, s3.direct("home"))
	// Minutes of outages: a paced workload keeps the history, and so each
	// snapshot's check, small.
	r.pace = 40
	d := r.boot()
	w := r.startWorkload()
	r.waitProgress(50, w)
	r.m.readJournal(t)
	r.waitPublished(d, r.m.lines, 60*time.Second)

	always := func(f ...faultproxy.Fault) faultproxy.Rule {
		i := 0
		return func(faultproxy.Request) faultproxy.Fault { i++; return f[i%len(f)] }
	}
	phases := []struct {
		name    string
		rule    faultproxy.Rule
		hole    bool          // hold every request (a black hole) instead
		acting  bool          // some requests act before failing: LATEST may move
		lapse   bool          // last until the writer lease has lapsed
		minimum time.Duration // at least this long
	}{
		{name: "500s", rule: always(faultproxy.Error500), minimum: 5 * time.Second},
		{name: "503 SlowDown", rule: always(faultproxy.SlowDown), minimum: 5 * time.Second},
		{name: "resets and errors after acting", rule: always(faultproxy.Reset, faultproxy.ResetAfter, faultproxy.ErrorAfter, faultproxy.Truncate), acting: true, minimum: 5 * time.Second},
		{name: "outage past the lease", rule: always(faultproxy.Reset), lapse: true, minimum: 5 * time.Second},
		{name: "black hole", hole: true, minimum: 8 * time.Second},
	}
	for _, ph := range phases {
		before, _ := r.cat.LatestID(t.Context())
		acks0 := r.acks()
		t0 := time.Now()
		t.Logf("phase %q", ph.name)
		if ph.hole {
			stall.setHold(func(string, string) bool { return true })
		} else {
			s3.faults.SetRule(ph.rule)
		}
		var st daemon.StatusReport
		for {
			select {
			case <-w.done:
				t.Fatalf("%s: the workload ended:\n%s", ph.name, w.stderr)
			default:
			}
			st, _ = r.h.statusJSON(r.mp)
			long := time.Since(t0) >= ph.minimum
			// A failing store shows in the status once a snapshot
			// has used up its retries, which may take longer than
			// the phase's minimum; a black hole holds every request,
			// so nothing fails until it ends.
			failed := ph.hole || (st.LastError != "" && !st.LastErrorAt.Before(t0))
			// An outage past the lease's life shows as the lease
			// lapsed (nobody took it over: it is taken again).
			if long && failed && (!ph.lapse || st.Lease == "lapsed") {
				break
			}
			if time.Since(t0) > 70*time.Second {
				if ph.lapse && st.Lease != "lapsed" {
					t.Fatalf("%s: the lease never lapsed in 70s (status %+v)", ph.name, st)
				}
				t.Fatalf("%s: status shows no error from the outage after 70s: %q at %v", ph.name, st.LastError, st.LastErrorAt)
			}
			sleepMillis(200)
		}
		// Local I/O never waited for the store.
		if n := r.acks() - acks0; n < 30 {
			t.Errorf("%s: the workload acknowledged only %d ops in %s while the store was failing", ph.name, n, time.Since(t0).Round(time.Second))
		}
		if after, _ := r.cat.LatestID(t.Context()); after != before && !ph.acting {
			t.Errorf("%s: LATEST moved from %s to %s while every request failed", ph.name, before, after)
		}
		s3.faults.SetRule(nil)
		stall.setHold(nil)
		// The held requests fail the way a dead connection finally does.
		for drained := false; !drained; {
			select {
			case h := <-stall.held:
				h.release <- false
			default:
				drained = true
			}
		}
		r.m.readJournal(t)
		r.waitPublished(d, r.m.lines, 90*time.Second)
		t.Logf("phase %q: %d ops acknowledged during it, all published once the store was back", ph.name, r.acks()-acks0)
	}

	// SIGTERM while the store is down: exit 5, everything kept.
	s3.faults.SetRule(always(faultproxy.Reset))
	before, _ := r.cat.LatestID(t.Context())
	r.waitProgress(30, w)
	w.stop(t)
	if code := d.stop(syscall.SIGTERM); code != exitUnsynced {
		t.Fatalf("SIGTERM with the store down: exit %d, want %d\n%s", code, exitUnsynced, tail(d.stderr.String(), 40))
	}
	if st, _ := daemon.ReadState(r.h.state); !st.Unpublished {
		t.Errorf("state.json after exit 5: %+v", st)
	}
	if after, _ := r.cat.LatestID(t.Context()); after != before {
		t.Errorf("LATEST moved from %s to %s while the store was down", before, after)
	}
	r.m.readJournal(t)
	s3.faults.SetRule(nil)
	r.detach()
	// The next start publishes it; a new host sees it all.
	r.finish()
	ops, faults := s3.faults.Counts()
	t.Logf("%d snapshots verified, %d ops acknowledged; S3 requests %v; faults %v", r.stats.snapshots, r.m.acked, ops, faults)
}

// A daemon killed while one of its own threads waited on its own mount
// (the freeze's held chmod) never exits, and its mount hangs every request
// instead of failing with ENOTCONN; from outside, a stopped daemon looks
// the same. The next start must not hang on it: it aborts that connection
// and mounts.
func TestTortureRestartOverHungMount(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	if os.Geteuid() != 0 {
		t.Skip("aborting a FUSE connection needs root")
	}
	store := "file://" + e2eDir(t, "store")
	mp := filepath.Join(e2eDir(t, "home"), "h")
	os.Mkdir(mp, 0o755)
	h := newHost(t, store)
	d := h.mount(mp, "--interval", "0")
	if err := writeSynced(filepath.Join(mp, "f"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, []byte("published")); err != nil {
		t.Fatal(err)
	}
	if code, _, stderr := h.run("snapshot", mp); code != exitOK {
		t.Fatalf("snapshot: exit %d: %s", code, stderr)
	}
	d.cmd.Process.Signal(syscall.SIGSTOP)
	t.Cleanup(func() { d.cmd.Process.Kill() })

	// Another state dir: the stopped daemon keeps its own locked.
	d2 := newHost(t, store).mount(mp, "--read-only")
	if got := mustRead(t, filepath.Join(mp, "f")); got != "published" {
		t.Errorf("f = %q over the aborted mount", got)
	}
	if !strings.Contains(d2.stderr.String(), "aborted and detached the hung mount") {
		t.Errorf("the start should say it aborted a hung mount:\n%s", d2.stderr)
	}
	if code := d2.stop(syscall.SIGTERM); code != exitOK {
		t.Errorf("read-only mount: exit %d", code)
	}
	d.cmd.Process.Kill()
	d.wait()
}
