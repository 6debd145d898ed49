package main

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// lazyHome seeds dir with a home and a few MiB of incompressible files, so
// the archive spans a dozen chunks.
func lazyHome(t *testing.T, dir string) {
	t.Helper()
	seedHome(t, dir)
	for i := range 12 {
		b := make([]byte, 200<<10+i*1000)
		rand.Read(b)
		writeFile(t, filepath.Join(dir, "blobs", fmt.Sprintf("b%02d.bin", i)), string(b), 0o644)
	}
}

// publishHome publishes a fresh lazy home from host a and returns the tree
// and a's mountpoint.
func publishHome(t *testing.T, a *host) (map[string]entry, string) {
	t.Helper()
	mp := e2eDir(t, "homeA")
	lazyHome(t, mp)
	want := snapshotTree(t, mp)
	d := a.mount(mp, "--interval", "0")
	d.stopOK(t)
	return want, mp
}

// waitLazyComplete polls status until the lazy fill of d's mount is
// complete.
func waitLazyComplete(t *testing.T, h *host, d *daemonProc) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		r, _ := h.statusJSON(d.mp)
		if r.Lazy == nil {
			t.Fatalf("status shows no lazy fill: %+v", r)
		}
		if r.Lazy.Complete {
			if r.Lazy.PresentBytes != r.Lazy.TotalBytes {
				t.Fatalf("complete with %d of %d bytes", r.Lazy.PresentBytes, r.Lazy.TotalBytes)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("lazy fill not complete after 60s: %+v\n%s", *r.Lazy, tail(d.stderr.String(), 40))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// isSegmentPath tells the image data objects (segments, and whole
// archives of older formats, which later snapshots use as segments) from
// the rest (digests, extents lists, manifests).
func isSegmentPath(path string) bool {
	i := strings.LastIndex(path, "/segments/")
	if i < 0 {
		i = strings.LastIndex(path, "/snapshots/")
	}
	return i >= 0 && uploader.IsSegmentKey(path[i+1:])
}

// segmentGets counts the proxy's GETs of segment objects and can slow
// them down.
type segmentGets struct {
	mu    sync.Mutex
	n     int
	delay time.Duration
}

func (g *segmentGets) rule(r faultproxy.Request) faultproxy.Fault {
	if r.Op == "GetObject" && isSegmentPath(r.Path) {
		g.mu.Lock()
		g.n++
		d := g.delay
		g.mu.Unlock()
		time.Sleep(d) // a slow link: the proxy serves one request at a time
	}
	return faultproxy.Pass
}

func (g *segmentGets) set(d time.Duration) (before int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.delay = d
	return g.n
}

func (g *segmentGets) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

// TestE2ELazyBoot boots a new host lazily over a slow link, reads every
// file, lets the fill finish, and reboots without a segment GET; a second
// new host is killed mid-fill and finishes after a restart, its cache then
// holding every segment of the image whole, as stored.
func TestE2ELazyBoot(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	g := &segmentGets{}
	s3.faults.SetRule(g.rule)
	store := s3.url(s3.faults.URL, "lazy")
	want, _ := publishHome(t, newHost(t, store))

	g.set(10 * time.Millisecond)
	b := newHost(t, store)
	mp := e2eDir(t, "homeB")
	d := b.mount(mp, "--interval", "0")
	if !strings.Contains(d.stderr.String(), "booting lazily") {
		t.Fatalf("did not boot lazily:\n%s", d.stderr)
	}
	r, _ := b.statusJSON(mp)
	if r.Lazy == nil || r.Lazy.TotalBytes == 0 {
		t.Fatalf("status --json: no lazy fill: %+v", r.Lazy)
	}
	if _, out, _ := b.run("status", mp); !strings.Contains(out, "lazy fill:") {
		t.Fatalf("status shows no lazy fill:\n%s", out)
	}
	if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
		t.Fatalf("lazily booted tree differs:\n%s", diff)
	}
	waitLazyComplete(t, b, d)
	d.stopOK(t)

	// A reboot on this host needs no segment bytes from the store.
	before := g.set(0)
	d = b.mount(mp, "--interval", "0")
	if n := g.count() - before; n != 0 {
		t.Errorf("reboot with a complete cache made %d segment GETs", n)
	}
	if r, _ := b.statusJSON(mp); r.Lazy != nil {
		t.Errorf("reboot with a complete cache reads lazily: %+v", *r.Lazy)
	}
	if got := mustRead(t, filepath.Join(mp, "config.yaml")); !strings.HasPrefix(got, "model: test") {
		t.Fatalf("config.yaml after the reboot: %q", got)
	}
	d.stopOK(t)

	// kill -9 mid-fill, restart, finish.
	g.set(60 * time.Millisecond)
	c := newHost(t, store)
	mpC := e2eDir(t, "homeC")
	dc := c.mount(mpC, "--interval", "0")
	if code := dc.stop(syscall.SIGKILL); code != 128+int(syscall.SIGKILL) {
		t.Fatalf("kill -9: exit %d", code)
	}
	cache := filepath.Join(c.state, "cache", "segments")
	if partials, _ := filepath.Glob(filepath.Join(cache, "*.partial")); len(partials) == 0 {
		t.Logf("no partial cache after kill -9 (the fill finished first?)")
	}
	g.set(0)
	dc = c.mount(mpC, "--interval", "0")
	waitLazyComplete(t, c, dc)
	if diff := diffTrees(want, snapshotTree(t, mpC)); diff != "" {
		t.Fatalf("tree after a restart mid-fill differs:\n%s", diff)
	}
	dc.stopOK(t)
	storeDir := filepath.Join(s3.data, s3.bucket, "lazy")
	m := readManifest(t, storeDir, localLatest(t, storeDir))
	for _, seg := range m.Segments {
		got, err := os.ReadFile(filepath.Join(cache, image.PlainName(seg.Key)))
		if err != nil {
			t.Fatalf("segment %s of the image after the fill: %v", seg.Key, err)
		}
		if stored := mustRead(t, filepath.Join(storeDir, filepath.FromSlash(seg.Key))); string(got) != stored {
			t.Fatalf("the completed cache of segment %s differs from the stored object", seg.Key)
		}
	}
	for _, pat := range []string{"*.partial", "*.present", "*.etag"} {
		if left, _ := filepath.Glob(filepath.Join(cache, pat)); len(left) != 0 {
			t.Fatalf("lazy cache files left: %v", left)
		}
	}
}

// TestE2ELazyDamagedStore: bytes the store damaged never reach a reader;
// the read fails with EIO and the log names the segment, the chunk and the
// cause.
func TestE2ELazyDamagedStore(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	want, _ := publishHome(t, newHost(t, "file://"+storeDir))
	id := localLatest(t, storeDir)
	m := readManifest(t, storeDir, id)
	if m.MetaOffset <= 2*uploader.DefaultChunkSize {
		t.Fatalf("manifest meta_offset %d: want the data to span chunks", m.MetaOffset)
	}
	// In the data, far from the image's first chunk and its tables: the
	// segment byte the extents put there.
	x := storeExtents(t, storeDir, m).Slice(m.MetaOffset/2, 1)[0]
	sums := storeSums(t, storeDir, segmentRef(t, m, x.Key))
	flipStored(t, storeDir, x.Key, x.Offset, 0x10)
	h := newHost(t, "file://"+storeDir)
	mp := e2eDir(t, "homeB")
	d := h.mount(mp, "--interval", "0", "--read-timeout", "500ms")
	readDamaged(t, mp, want)
	r, _ := h.statusJSON(mp)
	if r.Lazy == nil || r.Lazy.Errors == 0 || r.Lazy.Complete {
		t.Fatalf("status: %+v", r.Lazy)
	}
	d.stop(syscall.SIGTERM)
	chunk := fmt.Sprintf("%s chunk %d", x.Key, x.Offset/sums.ChunkSize)
	if log := d.stderr.String(); !strings.Contains(log, "chunk sha256 does not match") || !strings.Contains(log, chunk) {
		t.Fatalf("log does not name the damaged chunk (%s):\n%s", chunk, log)
	}
}

// TestE2ELazyFormat1 boots a snapshot an older hermesfs published
// (manifest format 1: no chunk digests) by downloading its archive whole;
// the next snapshot on it is format 4 and uses that archive as a segment
// (its digests, computed then, stored beside it): only the new bytes go
// up, and a new host restores it exactly.
func TestE2ELazyFormat1(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	home := e2eDir(t, "homeA")
	lazyHome(t, home)
	want := snapshotTree(t, home)
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	old := publishTree(t, uploader.NewCatalog(s, uploader.CatalogOptions{Host: "old"}), home)
	// What an older hermesfs wrote: format 1, no digests.
	mp := filepath.Join(storeDir, filepath.FromSlash(uploader.ManifestKey(old.ID)))
	var raw map[string]any
	if err := json.Unmarshal([]byte(mustRead(t, mp)), &raw); err != nil {
		t.Fatal(err)
	}
	raw["format"] = 1
	for _, k := range []string{"chunk_size", "chunks", "meta_offset", "hot", "shared_prefix"} {
		delete(raw, k)
	}
	j, _ := json.Marshal(raw)
	if err := os.WriteFile(mp, j, 0o644); err != nil {
		t.Fatal(err)
	}
	if m := readManifest(t, storeDir, old.ID); m.Format != 1 || m.Lazy() || m.SHA256 == "" {
		t.Fatalf("not a format 1 manifest: %+v", m)
	}

	h := newHost(t, "file://"+storeDir)
	home2 := e2eDir(t, "homeB")
	d := h.mount(home2, "--interval", "0")
	cached := filepath.Join(h.state, "cache", "segments", image.PlainName(old.Archive))
	if fi, err := os.Stat(cached); strings.Contains(d.stderr.String(), "booting lazily") || err != nil || fi.Size() != old.Size {
		t.Fatalf("a format 1 snapshot was not downloaded whole (%v):\n%s", err, d.stderr)
	}
	if diff := diffTrees(want, snapshotTree(t, home2)); diff != "" {
		t.Fatalf("tree differs:\n%s", diff)
	}
	writeFile(t, filepath.Join(home2, "new.txt"), "on a format 1 base", 0o644)
	d.stopOK(t)

	id := localLatest(t, storeDir)
	m := readManifest(t, storeDir, id)
	if !m.Segmented() || m.Parent != old.ID {
		t.Fatalf("the snapshot on the format 1 base: format %d, parent %s", m.Format, m.Parent)
	}
	if r := segmentRef(t, m, old.Archive); r.Bytes < old.Size/2 {
		t.Errorf("the new image takes %d bytes of the old %d-byte archive", r.Bytes, old.Size)
	}
	if !fileExists(filepath.Join(storeDir, filepath.FromSlash(uploader.SumsKey(old.Archive)))) {
		t.Errorf("no digests stored beside the old archive used as a segment")
	}
	sent := publishedFigure(t, d.stderr.String(), id, "bytes_uploaded")
	if sent*4 > old.Size || m.NewBytes*4 > old.Size {
		t.Errorf("the snapshot on the format 1 base uploaded %d bytes (a %d-byte segment) for a %d-byte archive", sent, m.NewBytes, old.Size)
	}
	dir := filepath.Join(e2eDir(t, "restore"), "home")
	if code, out, errs := newHost(t, "file://"+storeDir).run("restore", dir); code != 0 {
		t.Fatalf("restore: exit %d %s%s", code, out, errs)
	}
	if got := mustRead(t, filepath.Join(dir, "new.txt")); got != "on a format 1 base" {
		t.Errorf("new.txt = %q", got)
	}
	if diff := diffTrees(want, withoutNew(snapshotTree(t, dir))); diff != "" {
		t.Errorf("restored tree differs:\n%s", diff)
	}
}

// publishedFigure reads figure name (bytes_uploaded=N...) off the
// daemon's "snapshot published" log line for snapshot id.
func publishedFigure(t *testing.T, log, id, name string) int64 {
	t.Helper()
	for line := range strings.Lines(log) {
		if !strings.Contains(line, "snapshot published") || !strings.Contains(line, "id="+id) {
			continue
		}
		i := strings.Index(line, " "+name+"=")
		if i < 0 {
			break
		}
		var n int64
		if _, err := fmt.Sscanf(line[i+len(name)+2:], "%d", &n); err != nil {
			t.Fatalf("%s in %q: %v", name, line, err)
		}
		return n
	}
	t.Fatalf("no \"snapshot published\" line with %s for %s:\n%s", name, id, log)
	return 0
}

// openImage opens snapshot id of the local store at storeDir as an
// archive (its image put together from the extents).
func openImage(t *testing.T, storeDir, id string) *archive.Reader {
	t.Helper()
	f, err := os.Open(localImage(t, storeDir, id))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	fi, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	r, err := archive.Open(f, fi.Size(), archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestE2ELazyHotAndStop: a change made right after a lazy boot is
// published by SIGTERM, packed on the partly fetched base: the unchanged
// blocks stay extents of the base's segment (not read, not uploaded), the
// manifest records the chunks the session read first, and the next boot
// on a host holding the base's segment whole fetches only the new
// segment, the hot set first.
func TestE2ELazyHotAndStop(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	a := newHost(t, "file://"+storeDir)
	_, mpA := publishHome(t, a)
	base := readManifest(t, storeDir, localLatest(t, storeDir))
	baseSeg := wholeSegment(t, storeDir, base)
	h := newHost(t, "file://"+storeDir)
	mp := e2eDir(t, "homeB")
	d := h.mount(mp, "--interval", "0")
	read := map[string]int64{"blobs/b07.bin": int64(len(mustRead(t, filepath.Join(mp, "blobs", "b07.bin"))))}
	read["config.yaml"] = int64(len(mustRead(t, filepath.Join(mp, "config.yaml"))))
	writeFile(t, filepath.Join(mp, "new.txt"), "made while lazy", 0o644)
	// The session rewrites one blob larger and grows the one it read:
	// both are new bytes, in the new segment, and what b07 was read as
	// is no longer where it was read from.
	big := make([]byte, 1<<20)
	rand.Read(big)
	writeFile(t, filepath.Join(mp, "blobs", "b02.bin"), string(big), 0o644)
	f, err := os.OpenFile(filepath.Join(mp, "blobs", "b07.bin"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(big[:10000])
	f.Close()
	d.stopOK(t)
	id := localLatest(t, storeDir)
	m := readManifest(t, storeDir, id)
	if !m.Segmented() || m.Parent != base.ID || len(m.Hot) == 0 {
		t.Fatalf("manifest of the final snapshot: format %d, parent %s, hot %v", m.Format, m.Parent, m.Hot)
	}
	if r := segmentRef(t, m, baseSeg.Key); r.Bytes < base.Size/2 {
		t.Errorf("the final image takes %d bytes of the base's %d-byte segment: not packed on the base", r.Bytes, baseSeg.Size)
	}
	if m.NewBytes*2 > m.Size {
		t.Errorf("the final snapshot's own segment holds %d of its %d image bytes", m.NewBytes, m.Size)
	}
	// The hot set names the chunks of the new image that hold what was
	// read (as it was read: the bytes b07 had then).
	nr := openImage(t, storeDir, id)
	for name, size := range read {
		fi, err := nr.Lstat(name)
		if err != nil {
			t.Fatal(err)
		}
		ext, err := nr.Extents(archive.Inode(fi.Sys().(*syscall.Stat_t).Ino))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ext {
			for c := e.At / m.ChunkSize; e.Off < size && c <= (e.At+e.Size-1)/m.ChunkSize; c++ {
				if !slices.Contains(m.Hot, c) {
					t.Fatalf("hot set %v lacks chunk %d, holding %s bytes %d-%d in the new image", m.Hot, c, name, e.Off, e.Off+e.Len)
				}
			}
		}
	}
	// Host a holds the base's segment whole in its cache: it fetches the
	// other segments only.
	var others int64
	for _, r := range m.Segments {
		if r.Key != baseSeg.Key {
			others += int64(uploader.NumChunks(r.Size, storeSums(t, storeDir, r).ChunkSize))
		}
	}
	da := a.mount(mpA, "--interval", "0")
	if got := mustRead(t, filepath.Join(mpA, "new.txt")); got != "made while lazy" {
		t.Fatalf("new.txt = %q", got)
	}
	if !strings.Contains(da.stderr.String(), fmt.Sprintf("hot_chunks=%d", len(m.Hot))) {
		t.Fatalf("the next boot did not take the hot set:\n%s", da.stderr)
	}
	waitLazyComplete(t, a, da)
	r, _ := a.statusJSON(mpA)
	if got := r.Lazy.OnDemandChunks + r.Lazy.FillChunks; got == 0 || int64(got) > others {
		t.Fatalf("the boot fetched %d chunks; the segments it lacked have %d: %+v", got, others, *r.Lazy)
	}
	da.stopOK(t)
}

// TestE2ELazyHotScan: a session that reads its startup files, then every
// file of the home in order (what a backup, tar or grep -r does), publishes
// a hot set within the byte bound that holds the startup's files and not
// the scan: the next host fetches first what a startup reads, not the
// whole image.
func TestE2ELazyHotScan(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	a := newHost(t, "file://"+storeDir)
	mpA := e2eDir(t, "homeA")
	seedHome(t, mpA)
	for i := range 64 {
		b := make([]byte, 256<<10)
		rand.Read(b)
		writeFile(t, filepath.Join(mpA, "blobs", fmt.Sprintf("b%02d.bin", i)), string(b), 0o644)
	}
	a.mount(mpA, "--interval", "0").stopOK(t)
	h := newHost(t, "file://"+storeDir)
	mp := e2eDir(t, "homeB")
	d := h.mount(mp, "--interval", "0")
	mustRead(t, filepath.Join(mp, "config.yaml"))
	mustRead(t, filepath.Join(mp, "memories", "MEMORY.md"))
	read := 0
	err := filepath.WalkDir(mp, func(p string, de os.DirEntry, err error) error {
		if err != nil || !de.Type().IsRegular() {
			return err
		}
		read++
		_, err = os.ReadFile(p)
		return err
	})
	if err != nil || read < 64 {
		t.Fatalf("read %d files: %v", read, err)
	}
	writeFile(t, filepath.Join(mp, "new.txt"), "after the scan", 0o644)
	d.stopOK(t)
	m := readManifest(t, storeDir, localLatest(t, storeDir))
	bound := min(64<<20, max(4<<20, m.Size/8)) // README "Lazy boot"
	if n := int64(len(m.Hot)) * m.ChunkSize; len(m.Hot) == 0 || n > bound/2 {
		t.Fatalf("hot set of %d chunks (%d KiB) of a %d KiB image; want the startup's few, within half the bound (%d KiB):\n%s",
			len(m.Hot), n>>10, m.Size>>10, bound>>10, d.stderr)
	}
	nr := openImage(t, storeDir, m.ID)
	for _, name := range []string{"config.yaml", "memories/MEMORY.md"} {
		fi, err := nr.Lstat(name)
		if err != nil {
			t.Fatal(err)
		}
		ext, err := nr.Extents(archive.Inode(fi.Sys().(*syscall.Stat_t).Ino))
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range ext {
			if c := e.At / m.ChunkSize; !slices.Contains(m.Hot, c) {
				t.Fatalf("hot set %v lacks chunk %d, holding %s", m.Hot, c, name)
			}
		}
	}
	if !strings.Contains(d.stderr.String(), "the session read in bulk") {
		t.Fatalf("the stop did not log the scan:\n%s", d.stderr)
	}
}

func readManifest(t *testing.T, storeDir, id string) uploader.Manifest {
	t.Helper()
	var m uploader.Manifest
	if err := json.Unmarshal([]byte(mustRead(t, filepath.Join(storeDir, "snapshots", id+".json"))), &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func sha256hex(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// readDamaged reads every regular file of want under mp from a store whose
// archive is damaged: some reads must fail with EIO, and none may return
// wrong bytes.
func readDamaged(t *testing.T, mp string, want map[string]entry) {
	t.Helper()
	eio := 0
	for name, e := range want {
		if !e.Mode.IsRegular() {
			continue
		}
		got, err := os.ReadFile(filepath.Join(mp, name))
		if errors.Is(err, syscall.EIO) {
			eio++
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if e.Size != int64(len(got)) || sha256hex(got) != e.Hash {
			t.Fatalf("%s: WRONG BYTES served from a damaged store", name)
		}
	}
	if eio == 0 {
		t.Fatal("no read failed, though the store's archive is damaged")
	}
}
