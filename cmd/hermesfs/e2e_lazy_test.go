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

// waitLazyComplete polls status until the lazy fill is complete.
func waitLazyComplete(t *testing.T, h *host, mp string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		r, _ := h.statusJSON(mp)
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
			t.Fatalf("lazy fill not complete after 60s: %+v", *r.Lazy)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// archiveGets counts the proxy's GETs of snapshot archives.
type archiveGets struct {
	mu    sync.Mutex
	n     int
	delay time.Duration
}

func (g *archiveGets) rule(r faultproxy.Request) faultproxy.Fault {
	if r.Op == "GetObject" && strings.Contains(r.Path, "/snapshots/") && strings.HasSuffix(r.Path, ".sqfs") {
		g.mu.Lock()
		g.n++
		d := g.delay
		g.mu.Unlock()
		time.Sleep(d) // a slow link: the proxy serves one request at a time
	}
	return faultproxy.Pass
}

func (g *archiveGets) set(d time.Duration) (before int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.delay = d
	return g.n
}

func (g *archiveGets) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.n
}

// TestE2ELazyBoot boots a new host lazily over a slow link, reads every
// file, lets the fill finish, and reboots without a data GET; a second new
// host is killed mid-fill and finishes after a restart.
func TestE2ELazyBoot(t *testing.T) {
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	g := &archiveGets{}
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
		t.Fatalf("status --json: no lazy fill: %+v", r)
	}
	if _, out, _ := b.run("status", mp); !strings.Contains(out, "lazy fill:") {
		t.Fatalf("status shows no lazy fill:\n%s", out)
	}
	if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
		t.Fatalf("lazily booted tree differs:\n%s", diff)
	}
	waitLazyComplete(t, b, mp)
	d.stopOK(t)

	// A reboot on this host needs no archive bytes from the store.
	before := g.set(0)
	d = b.mount(mp, "--interval", "0")
	if n := g.count() - before; n != 0 {
		t.Errorf("reboot with a complete cache made %d archive GETs", n)
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
	partials, _ := filepath.Glob(filepath.Join(c.state, "cache", "*.sqfs.partial"))
	if len(partials) != 1 {
		t.Logf("no partial cache after kill -9 (the fill finished first?)")
	}
	g.set(0)
	dc = c.mount(mpC, "--interval", "0")
	waitLazyComplete(t, c, mpC)
	if diff := diffTrees(want, snapshotTree(t, mpC)); diff != "" {
		t.Fatalf("tree after a restart mid-fill differs:\n%s", diff)
	}
	dc.stopOK(t)
	id := strings.TrimSpace(mustRead(t, filepath.Join(s3.data, s3.bucket, "lazy", "LATEST")))
	got, err := os.ReadFile(filepath.Join(c.state, "cache", id+".sqfs"))
	if err != nil {
		t.Fatal(err)
	}
	stored, err := os.ReadFile(filepath.Join(s3.data, s3.bucket, "lazy", "snapshots", id+".sqfs"))
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(stored) {
		t.Fatal("the completed cache differs from the stored archive")
	}
	if left, _ := filepath.Glob(filepath.Join(c.state, "cache", "*.sqfs.*")); len(left) != 0 {
		t.Fatalf("lazy cache files left: %v", left)
	}
}

// TestE2ELazyDamagedStore: bytes the store damaged never reach a reader;
// the read fails with EIO and the log names the chunk and the cause.
func TestE2ELazyDamagedStore(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	want, _ := publishHome(t, newHost(t, "file://"+storeDir))
	id := localLatest(t, storeDir)
	m := readManifest(t, storeDir, id)
	p := filepath.Join(storeDir, "snapshots", id+".sqfs")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if m.MetaOffset <= 2*m.ChunkSize {
		t.Fatalf("manifest meta_offset %d: want the data to span chunks", m.MetaOffset)
	}
	b[m.MetaOffset/2] ^= 0x10 // in the data, far from chunk 0 and the tail
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	h := newHost(t, "file://"+storeDir)
	mp := e2eDir(t, "homeB")
	d := h.mount(mp, "--interval", "0", "--read-timeout", "500ms")
	readDamaged(t, mp, want)
	r, _ := h.statusJSON(mp)
	if r.Lazy == nil || r.Lazy.Errors == 0 || r.Lazy.Complete {
		t.Fatalf("status: %+v", r.Lazy)
	}
	d.stop(syscall.SIGTERM)
	if log := d.stderr.String(); !strings.Contains(log, "chunk sha256 does not match the manifest") || !strings.Contains(log, "chunk "+fmt.Sprint(m.MetaOffset/2/m.ChunkSize)) {
		t.Fatalf("log does not name the damaged chunk:\n%s", log)
	}
}

// TestE2ELazyFormat1 boots a snapshot an older hermesfs published
// (manifest without chunk digests) the old way.
func TestE2ELazyFormat1(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	want, _ := publishHome(t, newHost(t, "file://"+storeDir))
	id := localLatest(t, storeDir)
	m := readManifest(t, storeDir, id)
	m.Format, m.ChunkSize, m.Chunks, m.MetaOffset, m.Hot, m.SharedPrefix = 1, 0, nil, 0, nil, 0
	j, _ := json.Marshal(m)
	if err := os.WriteFile(filepath.Join(storeDir, "snapshots", id+".json"), j, 0o644); err != nil {
		t.Fatal(err)
	}
	h := newHost(t, "file://"+storeDir)
	mp := e2eDir(t, "homeB")
	d := h.mount(mp, "--interval", "0")
	if strings.Contains(d.stderr.String(), "booting lazily") || !fileExists(filepath.Join(h.state, "cache", id+".sqfs")) {
		t.Fatalf("a format 1 snapshot was not downloaded whole:\n%s", d.stderr)
	}
	if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
		t.Fatalf("tree differs:\n%s", diff)
	}
	d.stopOK(t)
}

// TestE2ELazyHotAndStop: a change made right after a lazy boot is
// published by SIGTERM (packed on the partly fetched base), the manifest
// records the chunks read first and the prefix shared with the base, and
// the next boot on a host holding the older archive takes the shared
// chunks from it and the hot set first.
func TestE2ELazyHotAndStop(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	a := newHost(t, "file://"+storeDir)
	_, mpA := publishHome(t, a)
	h := newHost(t, "file://"+storeDir)
	mp := e2eDir(t, "homeB")
	d := h.mount(mp, "--interval", "0")
	read := map[string]int64{"blobs/b07.bin": int64(len(mustRead(t, filepath.Join(mp, "blobs", "b07.bin"))))}
	read["config.yaml"] = int64(len(mustRead(t, filepath.Join(mp, "config.yaml"))))
	writeFile(t, filepath.Join(mp, "new.txt"), "made while lazy", 0o644)
	// The session rewrites one blob larger and grows the one it read: the
	// new archive holds both after the old data, the read one elsewhere
	// than in the archive it was read from.
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
	if len(m.Hot) == 0 || !m.Lazy() || m.SharedPrefix == 0 {
		t.Fatalf("manifest of the final snapshot: hot %v, lazy %v, shared prefix %d", m.Hot, m.Lazy(), m.SharedPrefix)
	}
	// The hot set names the chunks of the new archive that hold what was
	// read (as it was read: the bytes b07 had then).
	na, err := os.Open(filepath.Join(storeDir, uploader.ArchiveKey(id)))
	if err != nil {
		t.Fatal(err)
	}
	defer na.Close()
	nr, err := archive.Open(na, m.Size, archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
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
					t.Fatalf("hot set %v lacks chunk %d, holding %s bytes %d-%d in the new archive", m.Hot, c, name, e.Off, e.Off+e.Len)
				}
			}
		}
	}
	// Host a holds the older archive in its cache.
	da := a.mount(mpA, "--interval", "0")
	if got := mustRead(t, filepath.Join(mpA, "new.txt")); got != "made while lazy" {
		t.Fatalf("new.txt = %q", got)
	}
	if !strings.Contains(da.stderr.String(), fmt.Sprintf("hot_chunks=%d", len(m.Hot))) {
		t.Fatalf("the next boot did not take the hot set:\n%s", da.stderr)
	}
	waitLazyComplete(t, a, mpA)
	r, _ := a.statusJSON(mpA)
	// Host a's cache holds the older segments the new image shares: only
	// the new segment's chunks come from the store.
	if fetched := r.Lazy.OnDemandChunks + r.Lazy.FillChunks; fetched*256<<10 >= r.Lazy.TotalBytes/2 {
		t.Fatalf("host a fetched %d chunks of a %d-byte image whose older segments it holds: %+v", fetched, r.Lazy.TotalBytes, *r.Lazy)
	}
	da.stopOK(t)
}

// TestE2ELazyHotScan: a session that reads its startup files, then every
// file of the home in order (what a backup, tar or grep -r does), publishes
// a hot set within the byte bound that holds the startup's files and not
// the scan: the next host fetches first what a startup reads, not the
// whole archive.
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
		t.Fatalf("hot set of %d chunks (%d KiB) of a %d KiB archive; want the startup's few, within half the bound (%d KiB):\n%s",
			len(m.Hot), n>>10, m.Size>>10, bound>>10, d.stderr)
	}
	na, err := os.Open(filepath.Join(storeDir, uploader.ArchiveKey(m.ID)))
	if err != nil {
		t.Fatal(err)
	}
	defer na.Close()
	nr, err := archive.Open(na, m.Size, archive.ReaderOptions{})
	if err != nil {
		t.Fatal(err)
	}
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
