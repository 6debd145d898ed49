package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// getLog records the ranged GETs that cross the fault proxy.
type getLog struct {
	mu     sync.Mutex
	keys   map[string]int   // GetObject requests by object path
	bytes  map[string]int64 // bytes asked for by range, by object path
	ranges map[string][][2]int64
}

func (g *getLog) rule(r faultproxy.Request) faultproxy.Fault {
	if r.Op != "GetObject" {
		return faultproxy.Pass
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.keys[r.Path]++
	var lo, hi int64
	if _, err := fmt.Sscanf(r.Range, "bytes=%d-%d", &lo, &hi); err == nil {
		g.bytes[r.Path] += hi - lo + 1
		if g.ranges == nil {
			g.ranges = map[string][][2]int64{}
		}
		g.ranges[r.Path] = append(g.ranges[r.Path], [2]int64{lo, hi})
	} else {
		g.bytes[r.Path] += 1 << 40 // a whole-object GET: fails any fraction
	}
	return faultproxy.Pass
}

func (g *getLog) reset() {
	g.mu.Lock()
	clear(g.keys)
	clear(g.bytes)
	clear(g.ranges)
	g.mu.Unlock()
}

// rangesOf returns the byte ranges (first, last) asked for of paths ending
// in suffix.
func (g *getLog) rangesOf(suffix string) [][2]int64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	var out [][2]int64
	for k, v := range g.ranges {
		if strings.HasSuffix(k, suffix) {
			out = append(out, v...)
		}
	}
	return out
}

// matching returns the GETs and bytes of paths ending in suffix.
func (g *getLog) matching(suffix string) (gets int, n int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for k, v := range g.keys {
		if strings.HasSuffix(k, suffix) {
			gets += v
			n += g.bytes[k]
		}
	}
	return gets, n
}

// browseHome writes a home of a few MiB of incompressible files around a
// small memory file.
func browseHome(t *testing.T, version int) string {
	dir := makeTree(t, version)
	for i := range 48 {
		b := make([]byte, 256<<10)
		rand.Read(b)
		p := filepath.Join(dir, "sessions", fmt.Sprintf("blob-%02d.bin", i))
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// putSyntheticSnapshots stores n snapshots with cheap manifests and
// one-byte archives, dated a day apart in 2025.
func putSyntheticSnapshots(t *testing.T, s uploader.Store, n int) {
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 8)
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			created := time.Date(2025, 1, 1, 12, 0, 0, 0, time.UTC).Add(time.Duration(i) * 24 * time.Hour)
			id := created.Format("20060102T150405.000Z") + fmt.Sprintf("-old-%08x", i)
			m := uploader.Manifest{Format: 1, ID: id, Created: created, Host: "old", Size: 1,
				SHA256: strings.Repeat("0", 64), Compression: "zstd", Archive: uploader.ArchiveKey(id)}
			mj, _ := json.Marshal(m)
			ctx := t.Context()
			if _, err := s.Put(ctx, uploader.ArchiveKey(id), bytes.NewReader([]byte{0}), 1, uploader.PutOptions{}); err != nil {
				errs <- err
				return
			}
			if _, err := s.Put(ctx, uploader.ManifestKey(id), bytes.NewReader(mj), int64(len(mj)), uploader.PutOptions{}); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

func TestBrowseS3(t *testing.T) {
	need(t, "/dev/fuse", "diff", "ls", "cat")
	endpoint, bucket, access, secret := s3test.Start(t)
	proxy, err := faultproxy.Start(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	log := &getLog{keys: map[string]int{}, bytes: map[string]int64{}}
	proxy.SetRule(log.rule)
	environ := map[string]string{
		"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1",
		"HERMESFS_S3_ENDPOINT": proxy.URL,
	}
	url := "s3://" + bucket + "/agents/alice"
	direct, _, err := storeurl.Open(t.Context(), url, storeurl.Options{Getenv: func(k string) string { return environ[k] }, Endpoint: endpoint})
	if err != nil {
		t.Fatal(err)
	}
	const synthetic = 500
	putSyntheticSnapshots(t, direct, synthetic)
	cat := uploader.NewCatalog(direct, uploader.CatalogOptions{Host: "vm"})
	oldHome := browseHome(t, 1)
	// 64 KiB digests: the chunks the reader fetches (the default 256 KiB
	// would be a large share of this small archive).
	old := publishTreeChunks(t, cat, oldHome, 64<<10)
	latest := publishTree(t, cat, makeTree(t, 2))

	mp := e2eDir(t, "mnt")
	ctx, cancel := context.WithCancel(t.Context())
	var out, errOut syncBuffer
	e := &env{stdout: &out, stderr: &errOut, getenv: func(k string) string { return environ[k] }}
	exited := make(chan int, 1)
	go func() {
		exited <- e.main(ctx, []string{"browse", "--store", url, "--chunk-size", "64K", "--refresh", "1ms", mp})
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-exited:
		case <-time.After(30 * time.Second):
			t.Error("browse did not stop within 30s of its context")
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), "ready ") {
		select {
		case code := <-exited:
			t.Fatalf("browse exited %d: %s", code, errOut.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("browse not ready after 30s: %s", errOut.String())
		}
		time.Sleep(10 * time.Millisecond)
	}

	// The root: one entry per snapshot plus aliases, from a listing alone
	// (the short --refresh makes ls list the store again).
	// A WAN's round trip on every request from here on: listing costs
	// requests, not archives (the time is logged, never asserted).
	proxy.SetLatency(20 * time.Millisecond)
	log.reset()
	proxy.ResetCounts()
	t0 := time.Now()
	ls, err := exec.Command("ls", "-l", mp).CombinedOutput()
	took := time.Since(t0)
	if err != nil {
		t.Fatalf("ls -l: %v\n%s", err, ls)
	}
	if !strings.Contains(string(ls), old.ID) || !strings.Contains(string(ls), "latest -> "+latest.ID) {
		t.Fatalf("ls -l does not show the snapshots:\n%s", ls)
	}
	if lines := strings.Count(string(ls), "\n") - 1; lines < synthetic+2 {
		t.Fatalf("ls -l lists %d entries for %d snapshots", lines, synthetic+2)
	}
	if gets, _ := log.matching(uploader.ArchiveExt); gets != 0 {
		t.Fatalf("listing the root fetched %d archive ranges", gets)
	}
	if gets, _ := log.matching(uploader.ManifestExt); gets != 0 {
		t.Fatalf("listing the root read %d manifests", gets)
	}
	ops, _ := proxy.Counts()
	t.Logf("ls -l of %d snapshots with 20 ms per request: %v in %v", synthetic+2, ops, took.Round(time.Millisecond))

	// One small file of the old snapshot: a small fraction of its archive.
	log.reset()
	b, err := exec.Command("cat", filepath.Join(mp, old.ID, "memories", "MEMORY.md")).Output()
	if err != nil || !strings.HasPrefix(string(b), "version 1\n") {
		t.Fatalf("cat MEMORY.md of %s: %q, %v", old.ID, b, err)
	}
	gets, fetched := log.matching(old.Archive)
	frac := float64(fetched) / float64(old.Size)
	t.Logf("cat of one small file: %d ranged GETs, %d of %d archive bytes (%.1f%%)", gets, fetched, old.Size, 100*frac)
	if frac > 0.02 {
		t.Errorf("cat of one small file fetched %.1f%% of the archive", 100*frac)
	}

	// Writes fail with EROFS.
	if err := os.WriteFile(filepath.Join(mp, old.ID, "memories", "MEMORY.md"), []byte("x"), 0o644); !errors.Is(err, syscall.EROFS) {
		t.Errorf("write into the snapshot: %v, want EROFS", err)
	}

	// restore --path: one file, by range.
	log.reset()
	dst := filepath.Join(t.TempDir(), "MEMORY.md")
	code, rout, rerr := runCLIEnv(t, environ, "restore", "--store", url, "--snapshot", old.ID, "--path", "memories/MEMORY.md", dst)
	if code != exitOK {
		t.Fatalf("restore --path: exit %d: %s", code, rerr)
	}
	if got, err := os.ReadFile(dst); err != nil || !bytes.Equal(got, b) {
		t.Fatalf("restored file: %q, %v; want %q", got, err, b)
	}
	_, fetched = log.matching(old.Archive)
	t.Logf("restore --path of one small file: %d of %d archive bytes (%.1f%%): %s", fetched, old.Size, 100*float64(fetched)/float64(old.Size), strings.TrimSpace(rout))
	if fetched > old.Size/50 {
		t.Errorf("restore --path of one small file fetched %d of %d archive bytes", fetched, old.Size)
	}
	// A directory subtree; then a name that is not there.
	sub := filepath.Join(t.TempDir(), "sessions")
	if code, _, rerr := runCLIEnv(t, environ, "restore", "--store", url, "--snapshot", old.ID, "--path", "/sessions/", sub); code != exitOK {
		t.Fatalf("restore --path of a directory: exit %d: %s", code, rerr)
	}
	if out, err := exec.Command("diff", "-r", filepath.Join(oldHome, "sessions"), sub).CombinedOutput(); err != nil {
		t.Fatalf("restored subtree differs: %v\n%s", err, out)
	}
	if code, _, rerr := runCLIEnv(t, environ, "restore", "--store", url, "--path", "memories/NOPE.md", filepath.Join(t.TempDir(), "x")); code == exitOK || !strings.Contains(rerr, "no such file") {
		t.Errorf("restore --path of a missing name: exit %d: %s", code, rerr)
	}
	if code, _, _ := runCLIEnv(t, environ, "restore", "--store", url, "--path", "../etc", filepath.Join(t.TempDir(), "x")); code != exitUsage {
		t.Errorf("restore --path ../etc: exit %d, want %d", code, exitUsage)
	}

	// diff -r of the mounted snapshot against a full restore of it.
	full := filepath.Join(t.TempDir(), "full")
	if code, _, rerr := runCLIEnv(t, environ, "restore", "--store", url, "--snapshot", old.ID, full); code != exitOK {
		t.Fatalf("restore: exit %d: %s", code, rerr)
	}
	if out, err := exec.Command("diff", "-r", "--no-dereference", filepath.Join(mp, old.ID), full).CombinedOutput(); err != nil {
		t.Fatalf("diff -r of the mounted snapshot and its restore: %v\n%s", err, out)
	}

	// hermesfs umount stops it cleanly.
	if code, uout, uerr := runCLIEnv(t, environ, "umount", mp); code != exitOK || !strings.Contains(uout, "unmounted") {
		t.Fatalf("umount: exit %d: %s %s", code, uout, uerr)
	}
	select {
	case code := <-exited:
		if code != exitOK {
			t.Fatalf("browse exited %d after umount: %s", code, errOut.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("browse still running 30s after umount")
	}
	exited <- exitOK // for the cleanup
	if !strings.Contains(out.String(), "unmounted "+mp) {
		t.Errorf("browse output: %q", out.String())
	}
}

// A browse tree on a local store stops cleanly when its context ends (the
// signal path), and bad flags lose nothing.
func TestBrowseStopsOnSignal(t *testing.T) {
	need(t, "/dev/fuse")
	storeDir := t.TempDir()
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	m := publishTree(t, uploader.NewCatalog(s, uploader.CatalogOptions{Host: "box"}), makeTree(t, 7))
	environ := map[string]string{"HERMESFS_STORE": "file://" + storeDir}
	mp := e2eDir(t, "mnt")
	for _, args := range [][]string{
		{"browse"},
		{"browse", "--cache-size", "lots", mp},
		{"browse", "--chunk-size", "1", mp},
		{"browse", filepath.Join(mp, "missing")},
	} {
		if code, _, errOut := runCLIEnv(t, environ, args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d: %s", args, code, exitUsage, errOut)
		}
	}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var out, errOut syncBuffer
	e := &env{stdout: &out, stderr: &errOut, getenv: func(k string) string { return environ[k] }}
	exited := make(chan int, 1)
	go func() { exited <- e.main(ctx, []string{"browse", "--cache-size", "1M", mp}) }()
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(out.String(), "ready ") {
		select {
		case code := <-exited:
			t.Fatalf("browse exited %d: %s", code, errOut.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("browse not ready after 30s: %s", errOut.String())
		}
	}
	b, err := os.ReadFile(filepath.Join(mp, "latest", "memories", "MEMORY.md"))
	if err != nil || !strings.HasPrefix(string(b), "version 7\n") {
		t.Errorf("MEMORY.md of %s: %q, %v", m.ID, b, err)
	}
	cancel()
	select {
	case code := <-exited:
		if code != exitOK {
			t.Fatalf("browse exited %d on its signal: %s", code, errOut.String())
		}
	case <-time.After(30 * time.Second):
		syscall.Unmount(mp, syscall.MNT_DETACH)
		t.Fatal("browse still running 30s after its signal")
	}
	if fs.IsMountpoint(mp) {
		t.Fatal("still mounted after browse exited")
	}
}

// A manifest with chunk digests has every fetched chunk checked: restore
// --path works with the right ones and fails as corrupt with wrong ones.
func TestRestorePathChunkDigests(t *testing.T) {
	storeDir := t.TempDir()
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	m := publishTree(t, uploader.NewCatalog(s, uploader.CatalogOptions{Host: "box"}), makeTree(t, 3))
	environ := map[string]string{"HERMESFS_STORE": "file://" + storeDir}
	data, err := os.ReadFile(filepath.Join(storeDir, uploader.ArchiveKey(m.ID)))
	if err != nil {
		t.Fatal(err)
	}
	const cs = 64 << 10
	var sums []string
	for off := 0; off < len(data); off += cs {
		sum := sha256.Sum256(data[off:min(len(data), off+cs)])
		sums = append(sums, hex.EncodeToString(sum[:]))
	}
	writeManifest := func(sums []string) {
		t.Helper()
		b, err := json.Marshal(struct {
			uploader.Manifest
			ChunkSize int64    `json:"chunk_size"`
			Chunks    []string `json:"chunks"`
		}{m, cs, sums})
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(storeDir, uploader.ManifestKey(m.ID)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeManifest(sums)
	dst := filepath.Join(t.TempDir(), "MEMORY.md")
	if code, _, errOut := runCLIEnv(t, environ, "restore", "--path", "memories/MEMORY.md", dst); code != exitOK {
		t.Fatalf("restore --path with chunk digests: exit %d: %s", code, errOut)
	}
	if b, _ := os.ReadFile(dst); !strings.HasPrefix(string(b), "version 3\n") {
		t.Fatalf("restored %q", b)
	}
	bad := slices.Clone(sums)
	for i := range bad {
		bad[i] = strings.Repeat("0", 64)
	}
	writeManifest(bad)
	dst2 := filepath.Join(t.TempDir(), "MEMORY.md")
	code, _, errOut := runCLIEnv(t, environ, "restore", "--path", "memories/MEMORY.md", dst2)
	if code != exitCorrupt || !strings.Contains(errOut, "digest") {
		t.Fatalf("restore --path with wrong chunk digests: exit %d: %s", code, errOut)
	}
	if _, err := os.Lstat(dst2); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed restore --path left %s: %v", dst2, err)
	}
	writeManifest(append(slices.Clone(sums), sums[0]))
	if code, _, errOut := runCLIEnv(t, environ, "restore", "--path", "memories/MEMORY.md", dst2); code == exitOK || !strings.Contains(errOut, "chunk digests") {
		t.Fatalf("restore --path with too many chunk digests: exit %d: %s", code, errOut)
	}
}
