package main

import (
	"crypto/rand"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// TestE2ELazyStopPublishesWithoutBase: SIGTERM right after a lazy boot
// over a slow link, with a change made, publishes that change without
// downloading the base: the snapshot is packed with the base's shared
// prefix left a hole, S3 copies those bytes from the base's object, and
// the manifest carries the base's chunk digests for them. Another host
// then restores it (checked chunk by chunk) with the change.
func TestE2ELazyStopPublishesWithoutBase(t *testing.T) {
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	store := s3.url(s3.faults.URL, "lazypack")
	t0 := time.Now()
	// Large enough that S3 copies most of it: a multipart upload's
	// parts are at least 5 MiB, and the first one (with the new
	// superblock) is sent.
	want, cat, base := publishBlobs(t, s3, "lazypack", 6, 2<<20)

	// A slow link from here on.
	s3.faults.SetRate(6 << 20)
	s3.faults.SetLatency(10 * time.Millisecond)
	t.Logf("published the base: %v", time.Since(t0))
	down0 := s3.faults.Stats().BytesDown
	b := newHost(t, store)
	mp := e2eDir(t, "homeB")
	d := b.mount(mp, "--interval", "0")
	if !strings.Contains(d.stderr.String(), "booting lazily") {
		t.Fatalf("did not boot lazily:\n%s", d.stderr)
	}
	writeFile(t, filepath.Join(mp, "new.txt"), "made right after a lazy boot", 0o644)
	downStop := s3.faults.Stats().BytesDown
	d.stopOK(t)
	down := s3.faults.Stats().BytesDown
	fetched, byStop := down-down0, down-downStop
	t.Logf("lazy boot, change, stop: %v", time.Since(t0))

	m, err := cat.Latest(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if m.ID == base.ID || m.Parent != base.ID {
		t.Fatalf("LATEST %s (parent %s) after the stop; base %s", m.ID, m.Parent, base.ID)
	}
	if m.SHA256 != "" || !m.Lazy() || m.SharedPrefix < base.Size/2 {
		t.Fatalf("final snapshot not packed on the partial base: sha256 %q, lazy %v, shared prefix %d of %d\n%s",
			m.SHA256, m.Lazy(), m.SharedPrefix, base.Size, d.stderr)
	}
	// The stop fetched the head part (5 MiB, S3's smallest part) and
	// the chunks the fill had in flight: far below the base. (What the
	// fill fetched before the stop depends on the machine's speed.)
	if byStop > base.Size*3/4 {
		t.Errorf("%d bytes downloaded by the stop for a %d-byte base", byStop, base.Size)
	}
	if fileExists(filepath.Join(b.state, "cache", base.ID+".sqfs")) || !fileExists(filepath.Join(b.state, "cache", base.ID+".sqfs.partial")) {
		t.Errorf("the base is not partly fetched after the stop")
	}
	t.Logf("base %d bytes; downloaded %d bytes from boot to exit, %d by the stop", base.Size, fetched, byStop)

	// Another host boots it lazily, every chunk checked on arrival and
	// all once more when complete. (A whole download checks every chunk
	// too: uploader's TestPublishHole.)
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
	waitLazyComplete(t, c, mpC)
	dc.stopOK(t)
	t.Logf("another host: %v", time.Since(t0))

	// The host that published it restarts: base + upper, the base still
	// partly fetched.
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
