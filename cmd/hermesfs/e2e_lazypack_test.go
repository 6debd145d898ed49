package main

import (
	"crypto/rand"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// TestE2ELazyStopPublishesWithoutBase: SIGTERM right after a lazy boot
// over a slow link, with a change made, publishes that change without
// fetching the base: the pack neither reads nor copies the base's blocks
// (the new image names them in the base's segments), so the stop uploads
// one small segment and downloads next to nothing. Another host then boots
// the snapshot lazily and restores it, verified, with the change; the
// host that published it restarts on its partly fetched base.
func TestE2ELazyStopPublishesWithoutBase(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	store := s3.url(s3.faults.URL, "lazypack")
	t0 := time.Now()
	want, cat, base := publishBlobs(t, s3, "lazypack", 6, 2<<20)
	if !base.Segmented() {
		t.Fatalf("the base is not a segmented snapshot: format %d", base.Format)
	}

	// A slow link from here on.
	s3.faults.SetRate(2 << 20)
	s3.faults.SetLatency(10 * time.Millisecond)
	t.Logf("published the base: %v", time.Since(t0))
	st0 := s3.faults.Stats()
	b := newHost(t, store)
	mp := e2eDir(t, "homeB")
	d := b.mount(mp, "--interval", "0")
	if !strings.Contains(d.stderr.String(), "booting lazily") {
		t.Fatalf("did not boot lazily:\n%s", d.stderr)
	}
	writeFile(t, filepath.Join(mp, "new.txt"), "made right after a lazy boot", 0o644)
	stStop := s3.faults.Stats()
	d.stopOK(t)
	st := s3.faults.Stats()
	fetched, byStop, upByStop := st.BytesDown-st0.BytesDown, st.BytesDown-stStop.BytesDown, st.BytesUp-stStop.BytesUp
	t.Logf("lazy boot, change, stop: %v", time.Since(t0))

	m, err := cat.Latest(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if m.ID == base.ID || m.Parent != base.ID {
		t.Fatalf("LATEST %s (parent %s) after the stop; base %s", m.ID, m.Parent, base.ID)
	}
	var fromBase int64
	for _, r := range base.Segments {
		fromBase += segmentRef(t, m, r.Key).Bytes
	}
	own := ownSegment(t, m)
	if fromBase < base.Size*3/4 || own.Size*4 > base.Size {
		t.Fatalf("final snapshot not packed on the base: %d of its %d image bytes from the base's segments, a new segment of %d bytes\n%s",
			fromBase, m.Size, own.Size, d.stderr)
	}
	// The stop sent its segment, digests, extents and manifest, and
	// fetched the chunks the fill had in flight at most: far below the
	// base either way. (What the fill fetched before the stop depends on
	// the machine's speed.)
	if upByStop > base.Size/4 {
		t.Errorf("%d bytes uploaded by the stop for a %d-byte base", upByStop, base.Size)
	}
	if byStop > base.Size/4 {
		t.Errorf("%d bytes downloaded by the stop for a %d-byte base", byStop, base.Size)
	}
	cache := filepath.Join(b.state, "cache", "segments")
	for _, r := range base.Segments {
		if fileExists(filepath.Join(cache, image.PlainName(r.Key))) {
			t.Logf("the fill completed base segment %s before the stop (a slow machine)", r.Key)
		} else if !fileExists(filepath.Join(cache, image.PlainName(r.Key)+".partial")) {
			t.Errorf("base segment %s is neither complete nor partly fetched in the cache", r.Key)
		}
	}
	t.Logf("base %d bytes; downloaded %d bytes from boot to exit, %d by the stop; the stop uploaded %d bytes (a %d-byte segment)",
		base.Size, fetched, byStop, upByStop, own.Size)

	// Another host boots it lazily, every chunk checked on arrival, and
	// restores it.
	s3.faults.SetRate(0)
	s3.faults.SetLatency(0)
	c := newHost(t, store)
	mpC := e2eDir(t, "homeC")
	dc := c.mount(mpC, "--interval", "0")
	if got := mustRead(t, filepath.Join(mpC, "new.txt")); got != "made right after a lazy boot" {
		t.Fatalf("new.txt = %q", got)
	}
	if diff := diffTrees(want, withoutNew(snapshotTree(t, mpC))); diff != "" {
		t.Fatalf("tree differs:\n%s", diff)
	}
	waitLazyComplete(t, c, dc)
	dc.stopOK(t)
	dir := filepath.Join(e2eDir(t, "restore"), "home")
	if code, out, errs := newHost(t, store).run("restore", "--snapshot", m.ID, dir); code != 0 {
		t.Fatalf("restore %s: exit %d %s%s", m.ID, code, out, errs)
	}
	if got := mustRead(t, filepath.Join(dir, "new.txt")); got != "made right after a lazy boot" {
		t.Fatalf("restored new.txt = %q", got)
	}
	if diff := diffTrees(want, withoutNew(snapshotTree(t, dir))); diff != "" {
		t.Fatalf("restored tree differs:\n%s", diff)
	}
	t.Logf("another host: %v", time.Since(t0))

	// The host that published it restarts: its image from the cache,
	// the base's segments still partly fetched.
	d = b.mount(mp, "--interval", "0")
	if got := mustRead(t, filepath.Join(mp, "new.txt")); got != "made right after a lazy boot" {
		t.Fatalf("after a restart: new.txt = %q", got)
	}
	if diff := diffTrees(want, withoutNew(snapshotTree(t, mp))); diff != "" {
		t.Fatalf("after a restart: tree differs:\n%s", diff)
	}
	d.stopOK(t)
}

// publishBlobs publishes, from a host of its own, a home with n
// incompressible blobs of size bytes to prefix of the S3 rig, and returns
// the tree, a catalog straight to the server, and the snapshot.
func publishBlobs(t *testing.T, s3 *s3Rig, prefix string, n, size int) (map[string]entry, *uploader.Catalog, uploader.Manifest) {
	t.Helper()
	a := newHost(t, s3.url(s3.faults.URL, prefix))
	mp := e2eDir(t, "homeA")
	seedHome(t, mp)
	for i := range n {
		b := make([]byte, size)
		rand.Read(b)
		writeFile(t, filepath.Join(mp, "blobs", fmt.Sprintf("b%d.bin", i)), string(b), 0o644)
	}
	want := snapshotTree(t, mp)
	a.mount(mp, "--interval", "0").stopOK(t)
	cat := storeCatalog(t, s3.direct(prefix))
	base, err := cat.Latest(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return want, cat, base
}

// withoutNew is tree without new.txt (checked on its own).
func withoutNew(tree map[string]entry) map[string]entry {
	delete(tree, "new.txt")
	return tree
}
