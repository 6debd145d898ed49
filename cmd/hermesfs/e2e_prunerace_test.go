package main

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
)

// browseProc is a running `hermesfs browse`.
type browseProc struct {
	cmd    *exec.Cmd
	stderr *syncBuffer
	done   chan struct{}
}

// browse starts `hermesfs browse MP` for h and waits for its ready line.
func (h *host) browse(mp string, args ...string) *browseProc {
	t := h.t
	t.Helper()
	cmd := exec.Command(hermesfsBin(t), append(append([]string{"browse"}, args...), mp)...)
	cmd.Env = h.env()
	cmd.Dir = "/"
	b := &browseProc{cmd: cmd, stderr: &syncBuffer{}, done: make(chan struct{})}
	cmd.Stderr = b.stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		sent := false
		for sc.Scan() {
			if !sent && strings.HasPrefix(sc.Text(), "ready ") {
				ready <- true
				sent = true
			}
		}
		close(ready)
	}()
	go func() { cmd.Wait(); close(b.done) }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-b.done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			<-b.done
		}
		if fs.IsMountpoint(mp) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
	})
	select {
	case ok := <-ready:
		if !ok {
			<-b.done
			t.Fatalf("hermesfs browse exited before ready:\n%s", b.stderr)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("hermesfs browse: no ready line after 60s:\n%s", b.stderr)
	}
	return b
}

// TestE2EPruneRacesReaders: a prune deletes the segment of a snapshot
// while a restore of it is under way (its segment GET in flight), while a
// browse has it open and while a read-only mount reads it lazily. Both fail cleanly, with an error naming the
// segment as gone from the store: the restore exits 3 having extracted
// nothing, the browse's reads of what it had not fetched fail with EIO,
// and so do those of a read-only mount on another host booted lazily on
// it; no wrong byte is served. The snapshot kept reads as before.
func TestE2EPruneRacesReaders(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	stall := startStallProxy(t, s3.faults.URL)
	storeDir := filepath.Join(s3.data, s3.bucket, "race")
	direct := s3.direct("race")

	// s1: a home of blobs; s2: every blob rewritten, so that s2 keeps
	// nothing of s1's segment (what it keeps of the small files is
	// copied out of it: a mostly dead segment).
	a := newHost(t, direct)
	mp := e2eDir(t, "home")
	seedHome(t, mp)
	blobs := func() {
		for i := range 4 {
			b := make([]byte, 1<<20)
			rand.Read(b)
			writeFile(t, filepath.Join(mp, "blobs", fmt.Sprintf("b%d.bin", i)), string(b), 0o644)
		}
	}
	blobs()
	want1 := snapshotTree(t, mp)
	a.mount(mp, "--interval", "0").stopOK(t)
	s1 := readManifest(t, storeDir, localLatest(t, storeDir))
	seg1 := wholeSegment(t, storeDir, s1)

	// A read-only mount on another host (no lease: a prune elsewhere
	// does not know its base), booted lazily on s1; every GET of s1's
	// file data (between the image's first chunk and the chunk of its
	// tables, which no boot reads) is held, so it has none of the blobs.
	sums1 := storeSums(t, storeDir, seg1)
	lo, hi := sums1.ChunkSize, s1.MetaOffset/sums1.ChunkSize*sums1.ChunkSize
	if hi-lo < 4*sums1.ChunkSize {
		t.Fatalf("s1's data spans [%d, %d): too little to hold", lo, hi)
	}
	lazyStall := startStallProxy(t, s3.faults.URL)
	lazyStall.setHoldRange(func(op, path, rng string) bool {
		var a, z int64
		_, err := fmt.Sscanf(rng, "bytes=%d-%d", &a, &z)
		return op == "GetObject" && strings.HasSuffix(path, "/"+seg1.Key) && err == nil && a >= lo && a < hi
	})
	lh := newHost(t, s3.url(lazyStall.URL, "race"))
	lmp := e2eDir(t, "lazy")
	ld := lh.mount(lmp, "--read-only", "--read-timeout", "2s")
	if !strings.Contains(ld.stderr.String(), "booting lazily") {
		t.Fatalf("the read-only mount did not boot lazily:\n%s", ld.stderr)
	}
	var lazyHeld []*heldRequest
	select {
	case h := <-lazyStall.held:
		lazyHeld = append(lazyHeld, h)
	case <-time.After(60 * time.Second):
		t.Fatalf("the read-only mount's fill asked for none of s1's data in 60s:\n%s", ld.stderr)
	}

	// The blobs replaced: the snapshot extends s1's image, which keeps
	// s1's blobs as garbage; its compaction copies what it still uses of
	// s1's segment, a small part of it, into its own.
	d := a.mount(mp, "--interval", "0")
	blobs()
	want2 := snapshotTree(t, mp)
	snapshotCompacted(t, a, d)
	d.stopOK(t)
	s2 := readManifest(t, storeDir, localLatest(t, storeDir))
	for _, r := range s2.Segments {
		if r.Key == seg1.Key {
			t.Fatalf("s2 still uses s1's segment %s: nothing to prune under a reader", seg1.Key)
		}
	}

	// A browse with s1 open: a small file of it read (its metadata
	// fetched), the blobs not.
	bh := newHost(t, direct)
	bmp := e2eDir(t, "browse")
	br := bh.browse(bmp, "--refresh", "1h", "--read-timeout", "1s")
	s1dir := filepath.Join(bmp, s1.ID)
	if got := mustRead(t, filepath.Join(s1dir, "config.yaml")); !strings.HasPrefix(got, "model: test") {
		t.Fatalf("browse: %s/config.yaml = %q", s1.ID, got)
	}

	// A restore of s1, its first GET of the segment held.
	stall.setHold(func(op, path string) bool { return op == "GetObject" && strings.HasSuffix(path, "/"+seg1.Key) })
	rh := newHost(t, s3.url(stall.URL, "race"))
	rdir := filepath.Join(e2eDir(t, "restore"), "home")
	restore := exec.Command(hermesfsBin(t), "restore", "--snapshot", s1.ID, rdir)
	restore.Env, restore.Dir = rh.env(), "/"
	var rout, rerr bytes.Buffer
	restore.Stdout, restore.Stderr = &rout, &rerr
	if err := restore.Start(); err != nil {
		t.Fatal(err)
	}
	restored := make(chan error, 1)
	go func() { restored <- restore.Wait() }()
	t.Cleanup(func() { restore.Process.Kill() })
	var held *heldRequest
	select {
	case held = <-stall.held:
	case err := <-restored:
		t.Fatalf("the restore ended (%v) before it read the segment:\n%s%s", err, rout.String(), rerr.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("the restore asked for no segment bytes in 60s:\n%s", rerr.String())
	}
	stall.setHold(nil)

	// An hour on (past the orphan grace), keep one: s1 goes, and its
	// segment, which no snapshot left uses.
	ageStore(t, storeDir, 2*time.Hour)
	if code, out, errs := newHost(t, direct).run("prune", "--keep-last", "1"); code != 0 {
		t.Fatalf("prune: exit %d %s%s", code, out, errs)
	}
	if fileExists(filepath.Join(storeDir, filepath.FromSlash(seg1.Key))) {
		t.Fatalf("prune kept segment %s, which no snapshot left uses", seg1.Key)
	}
	held.release <- true
	for drained := false; !drained; {
		select {
		case o := <-stall.held:
			o.release <- true
		default:
			drained = true
		}
	}
	var err error
	select {
	case err = <-restored:
	case <-time.After(120 * time.Second):
		t.Fatalf("the restore did not end within 120s of the prune:\n%s", rerr.String())
	}
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != exitCorrupt || !errNamesSegment(rerr.String(), seg1.Key) {
		t.Errorf("restore of a snapshot pruned under it: %v, want exit %d naming segment %s as gone:\n%s%s", err, exitCorrupt, seg1.Key, rout.String(), rerr.String())
	}
	t.Logf("restore: %s", strings.TrimSpace(rerr.String()))
	if ents, _ := os.ReadDir(rdir); len(ents) != 0 {
		t.Errorf("the failed restore extracted %d entries", len(ents))
	}

	// The browse: what it had not fetched of s1 fails with EIO, the rest
	// is right; the snapshot kept reads as before.
	for k := range want1 {
		if !strings.HasPrefix(k, "blobs") {
			delete(want1, k) // those may have come with config.yaml's chunk
		}
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("browse log:\n%s", br.stderr)
		}
	})
	readDamaged(t, s1dir, want1)
	if log := br.stderr.String(); !errNamesSegment(log, seg1.Key) {
		t.Errorf("the browse's log does not name segment %s as gone:\n%s", seg1.Key, log)
	}

	// The lazily booted read-only mount: its held GETs go on to a store
	// without the segment; what it had not fetched fails with EIO.
	lazyStall.setHoldRange(nil)
	for drained := false; !drained; {
		select {
		case h := <-lazyStall.held:
			lazyHeld = append(lazyHeld, h)
		default:
			drained = true
		}
	}
	for _, h := range lazyHeld {
		h.release <- true
	}
	readDamaged(t, lmp, want1)
	if log := ld.stderr.String(); !errNamesSegment(log, seg1.Key) {
		t.Errorf("the read-only mount's log does not name segment %s as gone:\n%s", seg1.Key, log)
	} else {
		t.Logf("the read-only mount: %s", logLine(log, "no longer in the store"))
	}
	ld.stop(syscall.SIGTERM)
	if diff := diffTrees(want2, snapshotTree(t, filepath.Join(bmp, s2.ID))); diff != "" {
		t.Errorf("browse of the snapshot kept differs:\n%s", diff)
	}
}

// errNamesSegment reports whether an error text names segment key as gone.
func errNamesSegment(text, key string) bool {
	return strings.Contains(text, key) && strings.Contains(text, "no longer in the store")
}

// TestE2EPruneRacesPublish: a prune on another host runs while a mount's
// publish is under way (its new segment, digests and extents uploaded, its
// manifest PUT held). The store is aged past the orphan grace first, so
// only the segment's name (a snapshot newer than the LATEST the prune
// read) keeps it: the publish then lands, LATEST names a complete
// snapshot, and a new host restores it exactly.
func TestE2EPruneRacesPublish(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	stall := startStallProxy(t, s3.faults.URL)
	storeDir := filepath.Join(s3.data, s3.bucket, "race")
	direct := s3.direct("race")

	// s0, then s1 on it (s0's segment still used), then the publish held.
	a := newHost(t, s3.url(stall.URL, "race"))
	mp := e2eDir(t, "home")
	seedHome(t, mp)
	blob := make([]byte, 2<<20)
	rand.Read(blob)
	writeFile(t, filepath.Join(mp, "blobs", "b0.bin"), string(blob), 0o644)
	a.mount(mp, "--interval", "0").stopOK(t)
	s0 := localLatest(t, storeDir)
	d := a.mount(mp, "--interval", "0")
	writeFile(t, filepath.Join(mp, "notes.txt"), "s1", 0o644)
	d.stopOK(t)
	s1 := localLatest(t, storeDir)
	if s1 == s0 {
		t.Fatal("the second mount published nothing")
	}

	d = a.mount(mp, "--interval", "0")
	rand.Read(blob)
	writeFile(t, filepath.Join(mp, "blobs", "b1.bin"), string(blob), 0o644)
	want2 := snapshotTree(t, mp)
	stall.setHold(func(op, path string) bool {
		return isUpload(op) && strings.Contains(path, "/snapshots/") && strings.HasSuffix(path, uploader.ManifestExt)
	})
	snap := exec.Command(hermesfsBin(t), "snapshot", mp)
	snap.Env, snap.Dir = a.env(), "/"
	var sout, serr bytes.Buffer
	snap.Stdout, snap.Stderr = &sout, &serr
	if err := snap.Start(); err != nil {
		t.Fatal(err)
	}
	snapped := make(chan error, 1)
	go func() { snapped <- snap.Wait() }()
	t.Cleanup(func() { snap.Process.Kill() })
	var held *heldRequest
	select {
	case held = <-stall.held:
	case err := <-snapped:
		t.Fatalf("the snapshot ended (%v) before its manifest upload:\n%s%s\n%s", err, sout.String(), serr.String(), d.stderr)
	case <-time.After(90 * time.Second):
		t.Fatalf("no manifest upload in 90s:\n%s", d.stderr)
	}
	stall.setHold(nil)
	id2 := strings.TrimSuffix(path.Base(held.Path), uploader.ManifestExt)
	seg2 := uploader.SegmentKey(id2, false)
	if !fileExists(filepath.Join(storeDir, filepath.FromSlash(seg2))) {
		t.Fatalf("the publish of %s holds its manifest, but its segment %s is not in the store", id2, seg2)
	}

	// Hours on, by the objects' times: only the name of the new segment
	// tells the prune it may be a publish in progress.
	ageStore(t, storeDir, 2*time.Hour)
	code, out, errs := newHost(t, direct).run("prune", "--keep-last", "1")
	if code != 0 {
		t.Fatalf("prune: exit %d %s%s", code, out, errs)
	}
	if fileExists(filepath.Join(storeDir, filepath.FromSlash(uploader.ManifestKey(s0)))) {
		t.Fatalf("prune --keep-last 1 kept %s (LATEST is %s): it pruned nothing\n%s", s0, s1, out)
	}
	for _, k := range []string{seg2, uploader.SumsKey(seg2), uploader.ExtentsKey(id2)} {
		if !fileExists(filepath.Join(storeDir, filepath.FromSlash(k))) {
			t.Errorf("prune deleted %s of the publish in progress:\n%s", k, out)
		}
	}

	held.release <- true
	held.settle(t)
	select {
	case err := <-snapped:
		if err != nil || strings.TrimSpace(sout.String()) != id2 {
			t.Fatalf("hermesfs snapshot: %v, printed %q, want %s:\n%s\n%s", err, sout.String(), id2, serr.String(), d.stderr)
		}
	case <-time.After(120 * time.Second):
		t.Fatalf("the snapshot did not end within 120s of the release:\n%s", d.stderr)
	}
	d.stopOK(t)
	if got := localLatest(t, storeDir); got != id2 {
		t.Fatalf("LATEST %s, want the publish that raced the prune, %s", got, id2)
	}
	checkStoreRefs(t, storeCatalog(t, direct))
	dir := filepath.Join(e2eDir(t, "restore"), "home")
	if code, out, errs := newHost(t, direct).run("restore", "--snapshot", id2, dir); code != 0 {
		t.Fatalf("restore %s: exit %d %s%s", id2, code, out, errs)
	}
	if diff := diffTrees(want2, snapshotTree(t, dir)); diff != "" {
		t.Errorf("restore of the snapshot published during the prune differs:\n%s", diff)
	}
}
