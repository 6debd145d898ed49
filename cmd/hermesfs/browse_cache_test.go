package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// publishSegmentTree packs dir on the image of prev, as the daemon does:
// every block prev's image holds is a copy, neither read nor uploaded
// again, and the snapshot is published as a format 4 image over prev's
// segments and one new segment of the rest.
func publishSegmentTree(t *testing.T, cat *uploader.Catalog, dir string, prev uploader.Manifest) uploader.Manifest {
	t.Helper()
	ctx := t.Context()
	prev, err := cat.Manifest(ctx, prev.ID) // as stored
	if err != nil {
		t.Fatal(err)
	}
	im, err := image.Open(ctx, prev, image.Options{Store: cat.Store(), CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer im.Close()
	base, err := archive.Open(im, im.Size(), archive.ReaderOptions{Name: prev.ID})
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "segment")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	res, err := archive.PackDir(ctx, f, dir, archive.PackOptions{Base: base, Segment: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	var ext []uploader.Extent
	for _, r := range res.Runs {
		if r.Source == nil {
			ext = append(ext, uploader.Extent{Offset: r.Offset, Length: r.Length})
			continue
		}
		if r.Source != base {
			t.Fatal("the pack copied from an archive other than its base")
		}
		ext = append(ext, im.Extents().Slice(r.Offset, r.Length)...)
	}
	pub, err := cat.PublishImage(ctx, uploader.ImageInput{Segment: p, Extents: ext, Sources: []uploader.Manifest{prev},
		Parent: prev.ID, Expect: prev.ID, Files: res.Files})
	if err != nil {
		t.Fatal(err)
	}
	return pub.Manifest
}

// cacheBytes walks dir and adds up the data its files hold on disk (their
// data extents: a punched hole holds none), apart from the small digests
// and extents lists, which are not chunks of snapshots.
func cacheBytes(t *testing.T, dir string) (chunks, files int64) {
	t.Helper()
	err := filepath.WalkDir(dir, func(p string, d iofs.DirEntry, err error) error {
		if errors.Is(err, iofs.ErrNotExist) {
			return nil // a file that went meanwhile
		}
		if err != nil || d.IsDir() {
			return err
		}
		f, err := os.Open(p)
		if errors.Is(err, iofs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return err
		}
		defer f.Close()
		var n int64
		for off := int64(0); ; {
			start, err := unix.Seek(int(f.Fd()), off, unix.SEEK_DATA)
			if errors.Is(err, unix.ENXIO) {
				break
			}
			if err != nil {
				return err
			}
			end, err := unix.Seek(int(f.Fd()), start, unix.SEEK_HOLE)
			if err != nil {
				return err
			}
			n += end - start
			off = end
		}
		files++
		if !strings.HasSuffix(p, uploader.SumsExt) && !strings.HasSuffix(p, uploader.ExtentsExt) {
			chunks += n
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return chunks, files
}

// startBrowse runs hermesfs browse with args in the test's process until
// the test ends, and waits for it to be ready.
func startBrowse(t *testing.T, environ map[string]string, args ...string) (out, errOut *syncBuffer, exited chan int) {
	t.Helper()
	mp := args[len(args)-1]
	ctx, cancel := context.WithCancel(t.Context())
	out, errOut = &syncBuffer{}, &syncBuffer{}
	e := &env{stdout: out, stderr: errOut, getenv: func(k string) string { return environ[k] }}
	exited = make(chan int, 1)
	go func() { exited <- e.main(ctx, append([]string{"browse"}, args...)) }()
	t.Cleanup(func() {
		cancel()
		select {
		case code := <-exited:
			exited <- code
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
	return out, errOut, exited
}

// copyTree copies dir to a new directory (the expected tree of a
// snapshot, while the home changes on).
func copyTree(t *testing.T, dir string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "tree")
	if out, err := exec.Command("cp", "-a", dir, dst).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
	return dst
}

// Browse reads every snapshot through one pool of verified range readers
// whose caches share --cache-size: format 4 images and the format 2
// archive they take most of their bytes from read the shared bytes once
// while they stay cached, many snapshots read whole keep the bytes on disk
// within the bound, a file whose bytes were evicted is fetched again, and
// what the store returns damaged is EIO, never wrong bytes.
func TestBrowseCacheBound(t *testing.T) {
	need(t, "/dev/fuse", "diff", "cat", "cp")
	endpoint, bucket, access, secret := s3test.Start(t)
	proxy, err := faultproxy.Start(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	log := &getLog{keys: map[string]int{}, bytes: map[string]int64{}}
	var damage atomic.Pointer[func(path string) bool]
	proxy.SetRule(func(r faultproxy.Request) faultproxy.Fault {
		log.rule(r)
		if d := damage.Load(); r.Op == "GetObject" && d != nil && (*d)(r.Path) {
			return faultproxy.FlipByte
		}
		return faultproxy.Pass
	})
	environ := map[string]string{
		"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1",
		"HERMESFS_S3_ENDPOINT": proxy.URL,
	}
	url := "s3://" + bucket + "/agents/bob"
	direct, _, err := storeurl.Open(t.Context(), url, storeurl.Options{Getenv: func(k string) string { return environ[k] }, Endpoint: endpoint})
	if err != nil {
		t.Fatal(err)
	}
	cat := uploader.NewCatalog(direct, uploader.CatalogOptions{Host: "vm"})

	// A format 2 snapshot of 48 incompressible 256 KiB files, then three
	// format 4 ones that each change four of them: most of every image
	// is extents of the first snapshot's archive.
	home := browseHome(t, 1)
	snaps := []uploader.Manifest{publishTree(t, cat, home)}
	trees := []string{copyTree(t, home)}
	for i := 1; i < 4; i++ {
		for j := range 4 {
			b := make([]byte, 256<<10)
			rand.Read(b)
			if err := os.WriteFile(filepath.Join(home, "sessions", fmt.Sprintf("blob-%02d.bin", 40+j)), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		snaps = append(snaps, publishSegmentTree(t, cat, home, snaps[i-1]))
		trees = append(trees, copyTree(t, home))
	}
	old := snaps[0]
	for _, m := range snaps[1:] {
		if !m.Segmented() || len(m.Segments) < 2 || m.NewBytes*4 > m.Size {
			t.Fatalf("snapshot %s: format %d, %d segments, %d new bytes of %d: not an image sharing segments", m.ID, m.Format, len(m.Segments), m.NewBytes, m.Size)
		}
	}
	t.Logf("4 snapshots of a %d-byte image each: one format 2 archive, then segments of %d, %d, %d bytes", old.Size, snaps[1].NewBytes, snaps[2].NewBytes, snaps[3].NewBytes)

	const cacheSize = 4 << 20
	cacheDir := t.TempDir()
	mp := e2eDir(t, "mnt")
	out, errOut, exited := startBrowse(t, environ, "--store", url, "--cache-size", "4M", "--cache-dir", cacheDir, mp)
	at := func(i int, name string) string { return filepath.Join(mp, snaps[i].ID, name) }
	want := func(i int, name string) []byte {
		b, err := os.ReadFile(filepath.Join(trees[i], name))
		if err != nil {
			t.Fatal(err)
		}
		return b
	}

	// Shared bytes, cached: a file of the format 4 snapshot that is
	// extents of the format 2 archive costs no GET of the bytes of that
	// archive the format 2 snapshot's read fetched. (Read-ahead may fetch
	// what lies after them, in either read.)
	const shared = "sessions/blob-05.bin"
	var cached [][2]int64
	for i := range 2 {
		log.reset()
		b, err := os.ReadFile(at(i, shared))
		if err != nil || !bytes.Equal(b, want(i, shared)) {
			t.Fatalf("%s of %s: %v (right bytes: %v)", shared, snaps[i].ID, err, bytes.Equal(b, want(i, shared)))
		}
		got := log.rangesOf(old.Archive)
		if i == 0 {
			if len(got) == 0 {
				t.Fatalf("%s of %s fetched nothing of its archive", shared, old.ID)
			}
			cached = got
			continue
		}
		for _, g := range got {
			for _, c := range cached {
				if g[0] <= c[1] && c[0] <= g[1] {
					t.Fatalf("%s of %s (format 4) fetched bytes %d-%d of %s again, which the format 2 snapshot's read fetched (%d-%d): the readers do not share them",
						shared, snaps[1].ID, g[0], g[1], old.Archive, c[0], c[1])
				}
			}
		}
	}

	// Three snapshots read whole: three times the bound in distinct
	// bytes, twelve times in reads.
	log.reset()
	for i := range 3 {
		if o, err := exec.Command("diff", "-r", filepath.Join(mp, snaps[i].ID), trees[i]).CombinedOutput(); err != nil {
			t.Fatalf("diff -r of snapshot %s: %v\n%s", snaps[i].ID, err, o)
		}
	}
	gets, asked := log.matching(uploader.ArchiveExt)
	segGets, segAsked := log.matching(uploader.SegmentExt)
	gets, asked = gets+segGets, asked+segAsked
	// Read-ahead may be finishing: the bound holds once it has settled.
	var onDisk, files int64
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if onDisk, files = cacheBytes(t, cacheDir); onDisk <= cacheSize {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after reading 3 snapshots whole, the cache holds %d bytes of chunks on disk (%d files); --cache-size is %d", onDisk, files, cacheSize)
		}
	}
	t.Logf("diff -r of 3 snapshots (%d bytes each) with --cache-size 4M: %d ranged GETs of archives and segments, %d bytes asked for; %d bytes of chunks on disk in %d files",
		old.Size, gets, asked, onDisk, files)

	// Evicted bytes are fetched again, and checked: the fourth snapshot,
	// never entered, has files whose bytes the others read long ago.
	log.reset()
	const again = "sessions/blob-20.bin"
	if b, err := os.ReadFile(at(3, again)); err != nil || !bytes.Equal(b, want(3, again)) {
		t.Fatalf("%s of %s: %v", again, snaps[3].ID, err)
	}
	if gets, _ := log.matching(old.Archive); gets == 0 {
		t.Fatalf("%s of %s read evicted bytes without fetching them again", again, snaps[3].ID)
	}
	// The store damages what it returns of the format 2 archive and of
	// the fourth snapshot's own segment.
	own := uploader.SegmentKey(snaps[3].ID, false)
	damaged := func(p string) bool { return strings.HasSuffix(p, old.Archive) || strings.HasSuffix(p, own) }
	damage.Store(&damaged)
	for _, name := range []string{"sessions/blob-10.bin", "sessions/blob-41.bin"} {
		b, err := exec.Command("cat", at(3, name)).Output()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || !strings.Contains(string(ee.Stderr), "Input/output error") {
			t.Fatalf("cat %s of %s from a store that damages it: %v; want EIO", name, snaps[3].ID, err)
		}
		if !bytes.HasPrefix(want(3, name), b) {
			t.Fatalf("cat %s of %s from a store that damages it printed wrong bytes", name, snaps[3].ID)
		}
	}
	damage.Store(nil)

	if code, _, uerr := runCLIEnv(t, environ, "umount", mp); code != exitOK {
		t.Fatalf("umount: exit %d: %s", code, uerr)
	}
	select {
	case code := <-exited:
		exited <- code
		if code != exitOK {
			t.Fatalf("browse exited %d: %s", code, errOut.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("browse still running 30s after umount")
	}
	t.Logf("browse: %s", strings.TrimSpace(out.String()))
	if ents, err := os.ReadDir(cacheDir); err != nil || len(ents) != 0 {
		t.Fatalf("browse left %d entries in --cache-dir: %v", len(ents), err)
	}
}

// rewriteFormat1 makes m's stored manifest a format 1 one: no chunk
// digests, as an older hermesfs wrote.
func rewriteFormat1(t *testing.T, s uploader.Store, m uploader.Manifest) {
	t.Helper()
	m.Format, m.ChunkSize, m.Chunks, m.MetaOffset, m.Hot = 1, 0, nil, 0, nil
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(t.Context(), uploader.ManifestKey(m.ID), bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
}

// Format 1 snapshots (no chunk digests) are read by range too, each block
// checked against the archive's own checksums, in browse and restore
// --path; one whose archive has no block checksums either (not written by
// hermesfs) is refused with what to do instead.
func TestBrowseFormat1(t *testing.T) {
	need(t, "/dev/fuse", "mksquashfs")
	storeDir := t.TempDir()
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "old"})
	v1 := publishTree(t, cat, makeTree(t, 1))
	rewriteFormat1(t, s, v1)
	// An archive mksquashfs wrote: no integrity trailer.
	foreign := filepath.Join(t.TempDir(), "foreign.sqfs")
	if out, err := exec.Command("mksquashfs", makeTree(t, 2), foreign, "-quiet", "-no-progress", "-comp", "zstd").CombinedOutput(); err != nil {
		t.Fatalf("mksquashfs: %v: %s", err, out)
	}
	v2, err := cat.Publish(t.Context(), uploader.PublishInput{Path: foreign, Parent: v1.ID, Expect: v1.ID})
	if err != nil {
		t.Fatal(err)
	}
	rewriteFormat1(t, s, v2)
	environ := map[string]string{"HERMESFS_STORE": "file://" + storeDir}

	dst := filepath.Join(t.TempDir(), "MEMORY.md")
	if code, _, errOut := runCLIEnv(t, environ, "restore", "--snapshot", v1.ID, "--path", "memories/MEMORY.md", dst); code != exitOK {
		t.Fatalf("restore --path of a format 1 snapshot: exit %d: %s", code, errOut)
	}
	if b, _ := os.ReadFile(dst); !strings.HasPrefix(string(b), "version 1\n") {
		t.Fatalf("restore --path of a format 1 snapshot wrote %q", b)
	}
	dst2 := filepath.Join(t.TempDir(), "MEMORY.md")
	code, _, errOut := runCLIEnv(t, environ, "restore", "--snapshot", v2.ID, "--path", "memories/MEMORY.md", dst2)
	if code == exitOK || !strings.Contains(errOut, "restore it whole") {
		t.Fatalf("restore --path of a format 1 snapshot without block checksums: exit %d: %s", code, errOut)
	}
	if _, err := os.Lstat(dst2); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a refused restore --path left %s", dst2)
	}

	mp := e2eDir(t, "mnt")
	_, errOutB, _ := startBrowse(t, environ, "--chunk-size", "16K", mp)
	if b, err := os.ReadFile(filepath.Join(mp, v1.ID, "memories", "MEMORY.md")); err != nil || !strings.HasPrefix(string(b), "version 1\n") {
		t.Fatalf("MEMORY.md of the format 1 snapshot: %q, %v", b, err)
	}
	if _, err := os.ReadDir(filepath.Join(mp, v2.ID)); !errors.Is(err, syscall.EIO) {
		t.Fatalf("entering a format 1 snapshot without block checksums: %v; want EIO", err)
	}
	if !strings.Contains(errOutB.String(), "restore it whole") {
		t.Fatalf("browse's log does not say why it refused the snapshot: %s", errOutB.String())
	}
}
