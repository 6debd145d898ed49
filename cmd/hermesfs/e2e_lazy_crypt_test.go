package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// encryptedHost is a host that encrypts to, and decrypts with, key.
func encryptedHost(t *testing.T, store, key, pub string) *host {
	t.Helper()
	h := newHost(t, store)
	h.extraEnv = []string{"HERMESFS_ENCRYPT_TO=" + pub, "HERMESFS_IDENTITY=" + key}
	return h
}

func newTestKey(t *testing.T) (key, pub string) {
	t.Helper()
	key = filepath.Join(e2eDir(t, "keys"), "key.txt")
	pub, err := crypt.WriteNewKey(key, "test")
	if err != nil {
		t.Fatal(err)
	}
	return key, pub
}

// checkPlaintextCache checks that the completed cache of snapshot id on h
// holds its segments as plaintext files, with no ciphertext or partial
// file left beside them, and that state.json names it as the base.
func checkPlaintextCache(t *testing.T, h *host, id string) {
	t.Helper()
	var m uploader.Manifest
	if err := json.Unmarshal([]byte(mustRead(t, filepath.Join(h.state, "cache", id+".json"))), &m); err != nil {
		t.Fatalf("cached manifest of %s: %v", id, err)
	}
	dir := filepath.Join(h.state, "cache", "segments")
	for _, r := range m.Segments {
		p := filepath.Join(dir, image.PlainName(r.Key))
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) == 0 || crypt.IsEncrypted(b) {
			t.Fatalf("the completed cache %s is not plaintext", p)
		}
	}
	var st daemon.PersistedState
	sj, _ := os.ReadFile(filepath.Join(h.state, "state.json"))
	if err := json.Unmarshal(sj, &st); err != nil {
		t.Fatal(err)
	}
	if st.Base != id {
		t.Fatalf("state.json: base %s; want %s", st.Base, id)
	}
	for _, pat := range []string{"*.age", "*.partial", "*.present"} {
		if left, _ := filepath.Glob(filepath.Join(dir, pat)); len(left) != 0 {
			t.Fatalf("cache files left: %v", left)
		}
	}
}

// TestE2ELazyEncrypted boots a new host lazily from an encrypted snapshot
// over a slow link: ready before the segments are fetched, every file reads
// back, the completed cache is the plaintext of every segment (a reboot
// makes no segment GET); a second new host is killed mid-fill, its
// partial cache ciphertext, and finishes after a restart.
func TestE2ELazyEncrypted(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	s3 := startS3Rig(t)
	g := &segmentGets{}
	s3.faults.SetRule(g.rule)
	store := s3.url(s3.faults.URL, "lazyenc")
	storeDir := filepath.Join(s3.data, s3.bucket, "lazyenc")
	key, pub := newTestKey(t)
	want, _ := publishHome(t, encryptedHost(t, store, key, pub))
	id := localLatest(t, storeDir)
	m := readManifest(t, storeDir, id)
	var stored int64
	for _, r := range m.Segments {
		b, err := os.ReadFile(filepath.Join(storeDir, filepath.FromSlash(r.Key)))
		if err != nil || !strings.HasSuffix(r.Key, uploader.EncryptedExt) || !crypt.IsEncrypted(b) {
			t.Fatalf("segment %s of %s is not an age file (%v)", r.Key, id, err)
		}
		stored += int64(len(b))
	}

	g.set(10 * time.Millisecond)
	b := encryptedHost(t, store, key, pub)
	mp := e2eDir(t, "homeB")
	d := b.mount(mp, "--interval", "0")
	if log := d.stderr.String(); !strings.Contains(log, "booting lazily") || !strings.Contains(log, "encrypted=true") {
		t.Fatalf("did not boot lazily:\n%s", log)
	}
	r, _ := b.statusJSON(mp)
	if r.Lazy == nil || r.Lazy.TotalBytes != stored {
		t.Fatalf("status --json: lazy %+v, want the ciphertext's %d bytes", r.Lazy, stored)
	}
	if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
		t.Fatalf("lazily booted encrypted tree differs:\n%s", diff)
	}
	waitLazyComplete(t, b, d)
	d.stopOK(t)
	checkPlaintextCache(t, b, id)

	before := g.set(0)
	d = b.mount(mp, "--interval", "0")
	if n := g.count() - before; n != 0 {
		t.Errorf("reboot with a complete cache made %d segment GETs", n)
	}
	if got := mustRead(t, filepath.Join(mp, "config.yaml")); !strings.HasPrefix(got, "model: test") {
		t.Fatalf("config.yaml after the reboot: %q", got)
	}
	d.stopOK(t)

	// kill -9 mid-fill, restart, finish.
	g.set(60 * time.Millisecond)
	c := encryptedHost(t, store, key, pub)
	mpC := e2eDir(t, "homeC")
	dc := c.mount(mpC, "--interval", "0")
	if code := dc.stop(syscall.SIGKILL); code != 128+int(syscall.SIGKILL) {
		t.Fatalf("kill -9: exit %d", code)
	}
	cache := filepath.Join(c.state, "cache", "segments")
	if plain, _ := filepath.Glob(filepath.Join(cache, "*.seg.partial")); len(plain) != 0 {
		t.Fatalf("plaintext partial caches of encrypted segments: %v", plain)
	}
	if partials, _ := filepath.Glob(filepath.Join(cache, "*.seg.age.partial")); len(partials) == 0 {
		t.Logf("no partial cache after kill -9 (the fill finished first?)")
	} else {
		for _, p := range partials {
			// The header chunk is fetched at boot: the file starts
			// with age's.
			if pb, _ := os.ReadFile(p); !crypt.IsEncrypted(pb) {
				t.Fatalf("the partial cache %s is not ciphertext", p)
			}
		}
	}
	g.set(0)
	dc = c.mount(mpC, "--interval", "0")
	waitLazyComplete(t, c, dc)
	if diff := diffTrees(want, snapshotTree(t, mpC)); diff != "" {
		t.Fatalf("tree after a restart mid-fill differs:\n%s", diff)
	}
	dc.stopOK(t)
	checkPlaintextCache(t, c, id)
}

// TestE2ELazyEncryptedRefusals: without an identity a lazy boot of an
// encrypted snapshot exits 6 before fetching anything, with nothing
// mounted and nothing written in the state dir; a flipped ciphertext byte
// in a segment in the store is never served: reads of it fail with EIO
// and the log names the segment, the chunk and the digest mismatch.
func TestE2ELazyEncryptedRefusals(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	key, pub := newTestKey(t)
	want, _ := publishHome(t, encryptedHost(t, store, key, pub))
	id := localLatest(t, storeDir)

	noKey := newHost(t, store)
	noKey.extraEnv = []string{"HERMESFS_ENCRYPT_TO=" + pub}
	mp := e2eDir(t, "homeNoKey")
	dn := noKey.start(mp)
	if c := dn.wait(); c != exitCrypt || fs.IsMountpoint(mp) || !strings.Contains(dn.stderr.String(), id) || !strings.Contains(dn.stderr.String(), "X25519") {
		t.Fatalf("lazy boot without an identity: exit %d, mounted %v\n%s", c, fs.IsMountpoint(mp), dn.stderr)
	}
	if ents, _ := os.ReadDir(filepath.Join(noKey.state, "cache")); len(ents) != 0 {
		t.Errorf("a refused mount wrote %d entries in the cache", len(ents))
	}

	// The first snapshot's segment is its whole image: its middle is
	// file data, which no boot reads.
	m := readManifest(t, storeDir, id)
	seg := wholeSegment(t, storeDir, m)
	sums := storeSums(t, storeDir, seg)
	flip := seg.Size / 2
	if c := flip / sums.ChunkSize; c == 0 || c >= int64(len(sums.Chunks))-2 {
		t.Fatalf("segment of %d chunks: want the flipped byte (chunk %d) in the data", len(sums.Chunks), c)
	}
	flipStored(t, storeDir, seg.Key, flip, 0x10)
	h := encryptedHost(t, store, key, pub)
	mpH := e2eDir(t, "homeB")
	d := h.mount(mpH, "--interval", "0", "--read-timeout", "500ms")
	readDamaged(t, mpH, want)
	d.stop(syscall.SIGTERM)
	chunk := fmt.Sprintf("%s chunk %d", seg.Key, flip/sums.ChunkSize)
	if log := d.stderr.String(); !strings.Contains(log, "chunk sha256 does not match") || !strings.Contains(log, chunk) {
		t.Fatalf("log does not name the damaged chunk (%s):\n%s", chunk, log)
	}
}

// TestE2ELazyEncryptedDecryptResume: a daemon stopped after its fill
// completed but before the ciphertext was decrypted (each segment's
// complete age file in the cache, no plaintext) finishes the decryption
// at the next start without fetching the segments again; a complete
// ciphertext file that does not match its digests is not trusted.
func TestE2ELazyEncryptedDecryptResume(t *testing.T) {
	need(t, "/dev/fuse")
	t.Parallel()
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	key, pub := newTestKey(t)
	want, _ := publishHome(t, encryptedHost(t, store, key, pub))
	id := localLatest(t, storeDir)
	var m uploader.Manifest
	if err := json.Unmarshal([]byte(mustRead(t, filepath.Join(storeDir, "snapshots", id+".json"))), &m); err != nil {
		t.Fatal(err)
	}
	for _, damaged := range []bool{false, true} {
		h := encryptedHost(t, store, key, pub)
		mp := e2eDir(t, "home")
		d := h.mount(mp, "--interval", "0")
		waitLazyComplete(t, h, d)
		d.stopOK(t)
		checkPlaintextCache(t, h, id)
		// The state a crash between the fill's end and the decryption
		// leaves: each segment's complete ciphertext, no plaintext.
		var cache string
		for i, r := range m.Segments {
			stored, err := os.ReadFile(filepath.Join(storeDir, filepath.FromSlash(r.Key)))
			if err != nil {
				t.Fatal(err)
			}
			cache = filepath.Join(h.state, "cache", "segments", image.PlainName(r.Key))
			ct := append([]byte(nil), stored...)
			if damaged && i == 0 {
				ct[len(ct)/2] ^= 1
			}
			if err := os.WriteFile(cache+".age", ct, 0o600); err != nil {
				t.Fatal(err)
			}
			os.Remove(cache)
		}
		var st daemon.PersistedState
		sj, _ := os.ReadFile(filepath.Join(h.state, "state.json"))
		json.Unmarshal(sj, &st)
		st.CleanShutdown = false
		sj, _ = json.Marshal(st)
		if err := os.WriteFile(filepath.Join(h.state, "state.json"), sj, 0o600); err != nil {
			t.Fatal(err)
		}
		d = h.mount(mp, "--interval", "0")
		if r, _ := h.statusJSON(mp); damaged || r.Lazy != nil {
			// The damaged segment is fetched again; the intact one is
			// decrypted at boot, and the image is complete from the cache.
			waitLazyComplete(t, h, d)
			r, _ = h.statusJSON(mp)
			fetched := r.Lazy.OnDemandChunks + r.Lazy.FillChunks
			if damaged && fetched == 0 || !damaged && fetched != 0 {
				t.Errorf("damaged %v: %d chunks fetched from the store", damaged, fetched)
			}
		}
		if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
			t.Fatalf("tree differs:\n%s", diff)
		}
		deadline := time.Now().Add(30 * time.Second)
		for !fileExists(cache) || fileExists(cache+".age") {
			if time.Now().After(deadline) {
				t.Fatal("the complete ciphertext was not decrypted into the cache")
			}
			time.Sleep(20 * time.Millisecond)
		}
		d.stopOK(t)
		checkPlaintextCache(t, h, id)
	}
}
