package main

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// TestE2ELazyObjectReplaced: the base object a host boots lazily is
// replaced in the store under the daemon (same size, other bytes past what
// was fetched). The stop's snapshot must not have the store copy the
// replaced bytes into a new archive: it fails (exit 5), LATEST stays, and
// the change is kept in the state dir. Once the original object is back, the
// next start on that state dir publishes the change, and the new snapshot
// restores to the tree plus the change.
func TestE2ELazyObjectReplaced(t *testing.T) {
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	store := s3.url(s3.faults.URL, "replaced")
	// Large enough that S3 copies the shared middle (parts of 5 MiB or
	// more) rather than sending it.
	want, cat, base := publishBlobs(t, s3, "replaced", 6, 8<<20)
	direct, _, err := storeurl.Open(t.Context(), s3.direct("replaced"), storeurl.Options{UID: os.Getuid()})
	if err != nil {
		t.Fatal(err)
	}
	key := uploader.ArchiveKey(base.ID)
	rc, _, err := direct.Get(t.Context(), key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	orig, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || int64(len(orig)) != base.Size {
		t.Fatalf("reading the base: %d bytes, %v", len(orig), err)
	}
	put := func(b []byte) {
		t.Helper()
		if _, err := direct.Put(t.Context(), key, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// A slow link, so most of the base is still absent at the stop.
	s3.faults.SetRate(4 << 20)
	s3.faults.SetLatency(10 * time.Millisecond)
	b := newHost(t, store)
	mp := e2eDir(t, "homeB")
	d := b.mount(mp, "--interval", "0")
	if !strings.Contains(d.stderr.String(), "booting lazily") {
		t.Fatalf("did not boot lazily:\n%s", d.stderr)
	}
	writeFile(t, filepath.Join(mp, "new.txt"), "made before the base was replaced", 0o644)
	// Other bytes in the middle of the data (blobs' full blocks), which
	// the fill has not reached and the stop's pack does not read: the
	// new archive shares them with the base, for the store to copy. The
	// metadata and the fragments at the end stay as they were.
	replaced := bytes.Clone(orig)
	for off := base.MetaOffset * 2 / 5; off < base.MetaOffset*3/5; off += 64 << 10 {
		replaced[off] ^= 0xff
	}
	put(replaced)
	if code := d.stop(syscall.SIGTERM); code != 5 {
		t.Fatalf("stop with the base replaced: exit %d, want 5\n%s", code, d.stderr)
	}
	if !strings.Contains(d.stderr.String(), "does not match the manifest") {
		t.Errorf("the stop's log does not name the mismatch:\n%s", d.stderr)
	}
	if m, err := cat.Latest(t.Context()); err != nil || m.ID != base.ID {
		t.Fatalf("LATEST after the failed stop: %v, %v; want %s", m.ID, err, base.ID)
	}
	if got, err := os.ReadFile(filepath.Join(b.state, "upper", "new.txt")); err != nil || string(got) != "made before the base was replaced" {
		t.Fatalf("the change is not kept in the state dir: %q, %v", got, err)
	}

	// The original is put back (a versioned bucket's earlier version):
	// the next start publishes the kept change.
	put(orig)
	s3.faults.SetRate(0)
	s3.faults.SetLatency(0)
	d = b.mount(mp, "--interval", "0")
	if got := mustRead(t, filepath.Join(mp, "new.txt")); got != "made before the base was replaced" {
		t.Fatalf("after the restart: new.txt = %q", got)
	}
	d.stopOK(t)
	m, err := cat.Latest(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if m.ID == base.ID || m.Parent != base.ID {
		t.Fatalf("LATEST %s (parent %s) after the restart and stop; base %s", m.ID, m.Parent, base.ID)
	}
	if code, out, errOut := b.run("verify", m.ID); code != 0 {
		t.Fatalf("verify %s: exit %d\n%s%s", m.ID, code, out, errOut)
	}
	dir := e2eDir(t, "restored")
	if code, out, errOut := b.run("restore", dir); code != 0 {
		t.Fatalf("restore: exit %d\n%s%s", code, out, errOut)
	}
	if got := mustRead(t, filepath.Join(dir, "new.txt")); got != "made before the base was replaced" {
		t.Fatalf("restored new.txt = %q", got)
	}
	if diff := diffTrees(want, withoutNew(snapshotTree(t, dir))); diff != "" {
		t.Fatalf("restored tree differs:\n%s", diff)
	}
}
