package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// TestE2ELazyObjectReplaced: hermesfs never overwrites a segment, but a
// hand can. A segment replaced in the store (same size, other bytes) under
// a host that booted lazily from it is found out by its digests: reads of
// what it had not fetched fail with EIO and the log names the chunk; no
// wrong byte is served. The host's stop still publishes its change, whose
// image names that segment by its original digests: a restore fails
// loudly naming it rather than give the bytes there now, and a new host
// whose boot needs replaced bytes falls back, loudly, to the snapshot
// before. Once the original objects are back, the published snapshot
// restores to exactly the tree plus the change: nothing wrong was
// published.
func TestE2ELazyObjectReplaced(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	stall := startStallProxy(t, s3.faults.URL)
	storeDir := filepath.Join(s3.data, s3.bucket, "replaced")
	want, cat, base := publishBlobs(t, s3, "replaced", 6, 2<<20)
	seg := wholeSegment(t, storeDir, base)
	sums := storeSums(t, storeDir, seg)
	direct, _, err := storeurl.Open(t.Context(), s3.direct("replaced"), storeurl.Options{UID: os.Getuid()})
	if err != nil {
		t.Fatal(err)
	}
	// replace overwrites key by hand with b (no condition: not what
	// hermesfs ever does) and returns what it held.
	replace := func(key string, b []byte) []byte {
		t.Helper()
		old, err := os.ReadFile(filepath.Join(storeDir, filepath.FromSlash(key)))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := direct.Put(t.Context(), key, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		return old
	}
	flipped := func(b []byte, lo, hi int64) []byte {
		b = bytes.Clone(b)
		for off := lo; off < hi; off += 32 << 10 {
			b[off] ^= 0xff
		}
		return b
	}

	// The file data between the image's first chunk and the chunk of its
	// tables, which no boot reads: every GET of it is held until the
	// object has been replaced, so the lazily booted host has none of it.
	lo, hi := sums.ChunkSize, base.MetaOffset/sums.ChunkSize*sums.ChunkSize
	if hi-lo < 8*sums.ChunkSize {
		t.Fatalf("the base's data spans [%d, %d): too little to replace", lo, hi)
	}
	stall.setHoldRange(func(op, path, rng string) bool {
		var a, z int64
		_, err := fmt.Sscanf(rng, "bytes=%d-%d", &a, &z)
		return op == "GetObject" && strings.HasSuffix(path, "/"+seg.Key) && err == nil && a >= lo && a < hi
	})
	b := newHost(t, s3.url(stall.URL, "replaced"))
	mp := e2eDir(t, "homeB")
	d := b.mount(mp, "--interval", "0", "--read-timeout", "2s")
	if !strings.Contains(d.stderr.String(), "booting lazily") {
		t.Fatalf("did not boot lazily:\n%s", d.stderr)
	}
	writeFile(t, filepath.Join(mp, "new.txt"), "made before the base was replaced", 0o644)
	var held []*heldRequest
	select {
	case h := <-stall.held:
		held = append(held, h)
	case <-time.After(30 * time.Second):
		t.Fatalf("the fill asked for none of the base's data in 30s:\n%s", d.stderr)
	}
	origBase := replace(seg.Key, flipped(mustReadBytes(t, filepath.Join(storeDir, filepath.FromSlash(seg.Key))), lo, hi))
	stall.setHoldRange(nil)
	for drained := false; !drained; {
		select {
		case h := <-stall.held:
			held = append(held, h)
		default:
			drained = true
		}
	}
	for _, h := range held {
		h.release <- true // to the replaced object
	}
	readDamaged(t, mp, want)
	if r, _ := b.statusJSON(mp); r.Lazy == nil || r.Lazy.Errors == 0 {
		t.Errorf("status shows no fetch errors: %+v", r.Lazy)
	}
	if line := logLine(d.stderr.String(), seg.Key+" chunk "); line == "" {
		t.Errorf("the log does not name a chunk of the replaced segment %s:\n%s", seg.Key, d.stderr)
	} else {
		t.Logf("the lazily booted host: %s", line)
	}

	// The stop publishes the change on the base, reading none of it.
	d.stopOK(t)
	m, err := cat.Latest(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if m.ID == base.ID || m.Parent != base.ID {
		t.Fatalf("LATEST %s (parent %s) after the stop; base %s", m.ID, m.Parent, base.ID)
	}
	if r := segmentRef(t, m, seg.Key); r.SumsSHA256 != seg.SumsSHA256 {
		t.Fatalf("the new snapshot names the base's segment by other digests: %+v, was %+v", r, seg)
	}
	own := ownSegment(t, m)

	// A restore reads the replaced bytes: it fails, naming the segment,
	// and extracts nothing.
	dir := filepath.Join(e2eDir(t, "restore"), "home")
	c := newHost(t, s3.direct("replaced"))
	if code, out, errs := c.run("restore", "--snapshot", m.ID, dir); code != exitCorrupt || !strings.Contains(errs, seg.Key) {
		t.Errorf("restore of a snapshot whose segment was replaced: exit %d, want %d naming %s\n%s%s", code, exitCorrupt, seg.Key, out, errs)
	} else {
		t.Logf("restore: %s", strings.TrimSpace(errs))
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Errorf("a failed restore extracted %d entries", len(ents))
	}

	// The base's segment back (a versioned bucket's earlier version),
	// the new snapshot's own segment (the end of its image: the tables it
	// wrote, its trailer's root) replaced: a new host's boot needs those
	// bytes, finds them wrong, and falls back to the base.
	replace(seg.Key, origBase)
	x := storeExtents(t, storeDir, m).Slice(m.Size-1, 1)[0]
	if x.Key != own.Key {
		t.Fatalf("the end of the image of %s is in %s, not in its own segment", m.ID, x.Key)
	}
	origOwn := replace(own.Key, flipped(mustReadBytes(t, filepath.Join(storeDir, filepath.FromSlash(own.Key))), x.Offset, x.Offset+1))
	mpE := e2eDir(t, "homeE")
	e := newHost(t, s3.direct("replaced"))
	de := e.mount(mpE, "--read-only")
	if !strings.Contains(de.ready, "snapshot="+base.ID) {
		t.Errorf("ready line %q: want the fallback to %s", de.ready, base.ID)
	}
	if log := de.stderr.String(); !strings.Contains(log, m.ID) || !strings.Contains(log, "does not match") {
		t.Errorf("the boot does not say why it skipped %s:\n%s", m.ID, log)
	}
	if r, _ := e.statusJSON(mpE); !strings.Contains(r.LastError, m.ID) || !strings.Contains(r.LastError, "corrupt") {
		t.Errorf("status does not tell of the corrupt snapshot %s: %q", m.ID, r.LastError)
	}
	if diff := diffTrees(want, snapshotTree(t, mpE)); diff != "" {
		t.Errorf("the fallback mount differs from the base:\n%s", diff)
	}
	de.stopOK(t)

	// Its original back too: the published snapshot is exactly the tree
	// plus the change.
	replace(own.Key, origOwn)
	dir2 := filepath.Join(e2eDir(t, "restore"), "home")
	if code, out, errs := c.run("restore", "--snapshot", m.ID, dir2); code != 0 {
		t.Fatalf("restore %s: exit %d\n%s%s", m.ID, code, out, errs)
	}
	if got := mustRead(t, filepath.Join(dir2, "new.txt")); got != "made before the base was replaced" {
		t.Fatalf("restored new.txt = %q", got)
	}
	if diff := diffTrees(want, withoutNew(snapshotTree(t, dir2))); diff != "" {
		t.Fatalf("restored tree differs:\n%s", diff)
	}
}

// logLine returns the first line of log holding s ("" if none).
func logLine(log, s string) string {
	for line := range strings.Lines(log) {
		if strings.Contains(line, s) {
			return strings.TrimSpace(line)
		}
	}
	return ""
}

func mustReadBytes(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
