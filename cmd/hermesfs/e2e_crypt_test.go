package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// TestE2EEncrypted runs the encrypted life cycle through the binary: a
// home published encrypted (every segment an age file; no plaintext, no
// file name anywhere in the store), read back by the age CLI and
// unsquashfs, by export, verify and restore with the key, refused with
// exit 6 and nothing mounted without it, and a writer that forgot
// --encrypt-to refused before it mounts.
func TestE2EEncrypted(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "unsquashfs")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	keys := e2eDir(t, "keys")
	key := filepath.Join(keys, "key.txt")
	a := newHost(t, store)
	code, pub, stderr := a.run("keygen", key)
	pub = strings.TrimSpace(pub)
	if code != 0 || !strings.HasPrefix(pub, "age1") {
		t.Fatalf("keygen: %d %q %s", code, pub, stderr)
	}
	a.extraEnv = []string{"HERMESFS_ENCRYPT_TO=" + pub, "HERMESFS_IDENTITY=" + key}

	mp := filepath.Join(e2eDir(t, "home"), "hermes")
	seedHome(t, mp)
	d := a.mount(mp)
	if r, code := a.statusJSON(mp); code != 0 || r.Encryption == nil || r.Encryption.Scheme != "age" || strings.Join(r.Encryption.RecipientTypes, ",") != "X25519" {
		t.Errorf("status: %d %+v", code, r.Encryption)
	}
	mutateHome(t, mp)
	want := snapshotTree(t, mp)
	d.stopOK(t)
	id := localLatest(t, storeDir)
	m := readManifest(t, storeDir, id)
	if !m.Segmented() || m.Encryption == nil {
		t.Fatalf("the final snapshot: format %d, encryption %+v", m.Format, m.Encryption)
	}
	// Every object of the store: segments are age files; nothing holds
	// the home's plaintext or its file names.
	secrets := []string{"OPENAI_API_KEY", "sk-test", "likes tea", ".env", "MEMORY.md", "sessions", "state.db", "renamed.json"}
	err := filepath.WalkDir(storeDir, func(p string, de os.DirEntry, err error) error {
		if err != nil || de.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(storeDir, p)
		key := filepath.ToSlash(rel)
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if strings.HasPrefix(key, uploader.SegmentsPrefix) && !strings.HasSuffix(key, uploader.SumsExt) {
			if !strings.HasSuffix(key, uploader.SegmentExt+uploader.EncryptedExt) || !crypt.IsEncrypted(b) {
				t.Errorf("segment %s of an encrypted store is not an age file", key)
			}
		}
		for _, s := range secrets {
			if strings.Contains(string(b), s) {
				t.Errorf("%s holds %q", key, s)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range m.Segments {
		if !strings.HasSuffix(r.Key, uploader.SegmentExt+uploader.EncryptedExt) {
			t.Errorf("the encrypted snapshot uses segment %s", r.Key)
		}
	}
	var mj map[string]any
	if err := json.Unmarshal([]byte(mustRead(t, filepath.Join(storeDir, "snapshots", id+".json"))), &mj); err != nil {
		t.Fatal(err)
	}
	if _, ok := mj["files"]; ok || mj["encryption"] == nil || strings.Contains(fmt.Sprint(mj), "AGE-SECRET") {
		t.Errorf("manifest: %v", mj)
	}

	// Interop: the age CLI decrypts each segment, the extents list puts
	// the image together, and unsquashfs reads it.
	if strict() {
		need(t, "age") // scripts/deps.sh installs it
	}
	var plain string
	if _, err := exec.LookPath("age"); err == nil {
		plain = ageImage(t, storeDir, m, key)
		if diff := diffTrees(want, snapshotTree(t, unsquash(t, plain))); diff != "" {
			t.Errorf("age -d | unsquashfs differs:\n%s", diff)
		}
		// And the other way: an image the age CLI encrypted (to an SSH
		// key here) reads through hermesfs's decrypting ReaderAt.
		sshKey := filepath.Join(keys, "id_ed25519")
		if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", sshKey).CombinedOutput(); err != nil {
			t.Logf("ssh-keygen: %v %s: SSH interop not checked", err, out)
		} else {
			sealed := plain + ".age"
			if out, err := exec.Command("age", "-R", sshKey+".pub", "-o", sealed, plain).CombinedOutput(); err != nil {
				t.Fatalf("age -R: %v\n%s", err, out)
			}
			if code, out, errs := a.run("verify", "--identity", sshKey, sealed); code != 0 {
				t.Errorf("verify of the age CLI's file with the SSH key: %d %s %s", code, out, errs)
			}
		}
	} else {
		t.Log("age CLI not installed: interop with it not checked")
	}

	if code, out, _ := a.run("list"); code != 0 || !strings.Contains(out, "age: X25519") {
		t.Errorf("list: %d\n%s", code, out)
	}
	if code, out, errs := a.run("verify", id); code != 0 || !strings.Contains(out, "ok") {
		t.Errorf("verify with the key: %d %s %s", code, out, errs)
	}
	// The snapshot exported whole, as an age file: verify and unpack read
	// it through the decrypting ReaderAt, and age -d gives the image.
	obj := filepath.Join(e2eDir(t, "export"), id+".sqfs.age")
	if code, out, errs := a.run("export", "--snapshot", id, "--encrypt-to", pub, obj); code != 0 {
		t.Fatalf("export --encrypt-to: %d %s %s", code, out, errs)
	}
	if b, err := os.ReadFile(obj); err != nil || !crypt.IsEncrypted(b) {
		t.Fatalf("export with --encrypt-to did not write an age file (%v)", err)
	}
	if plain != "" {
		back := obj + ".plain"
		if out, err := exec.Command("age", "-d", "-i", key, "-o", back, obj).CombinedOutput(); err != nil {
			t.Fatalf("age -d of the export: %v\n%s", err, out)
		}
		if mustRead(t, back) != mustRead(t, plain) {
			t.Errorf("the exported image is not the image the extents put together")
		}
	}
	if code, _, errs := a.run("verify", obj); code != 0 {
		t.Errorf("verify FILE with the key: %d %s", code, errs)
	}
	out := filepath.Join(e2eDir(t, "unpack"), "root")
	if code, _, errs := a.run("unpack", obj, out); code != 0 {
		t.Errorf("unpack FILE: %d %s", code, errs)
	} else if diff := diffTrees(want, snapshotTree(t, out)); diff != "" {
		t.Errorf("unpack differs:\n%s", diff)
	}
	rdir := filepath.Join(e2eDir(t, "restore"), "root")
	if code, _, errs := a.run("restore", rdir); code != 0 {
		t.Errorf("restore: %d %s", code, errs)
	} else if diff := diffTrees(want, snapshotTree(t, rdir)); diff != "" {
		t.Errorf("restore differs:\n%s", diff)
	}
}

// ageImage puts snapshot m's image together from the local store at
// storeDir with standard tools only: age -d of each segment it uses, then
// the extents list's ranges of the plaintexts, in order.
func ageImage(t *testing.T, storeDir string, m uploader.Manifest, key string) string {
	t.Helper()
	dir := e2eDir(t, "age")
	plain := map[string]string{}
	for _, r := range m.Segments {
		p := filepath.Join(dir, image.PlainName(r.Key))
		if out, err := exec.Command("age", "-d", "-i", key, "-o", p, filepath.Join(storeDir, filepath.FromSlash(r.Key))).CombinedOutput(); err != nil {
			t.Fatalf("age -d %s: %v\n%s", r.Key, err, out)
		}
		plain[r.Key] = p
	}
	img := filepath.Join(dir, m.ID+".sqfs")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, x := range storeExtents(t, storeDir, m).List() {
		// dd's byte offsets: what a shell recipe does.
		cmd := exec.Command("dd", "if="+plain[x.Key], "iflag=skip_bytes,count_bytes", fmt.Sprintf("skip=%d", x.Offset), fmt.Sprintf("count=%d", x.Length), "bs=1M", "status=none")
		var errb bytes.Buffer
		cmd.Stdout, cmd.Stderr = f, &errb
		if err := cmd.Run(); err != nil {
			t.Fatalf("dd %s %d %d: %v %s", x.Key, x.Offset, x.Length, err, errb.String())
		}
	}
	if fi, err := f.Stat(); err != nil || fi.Size() != m.Size {
		t.Fatalf("the image put together has %v bytes, the manifest says %d (%v)", fi.Size(), m.Size, err)
	}
	return img
}

// TestE2EEncryptedRefusals: without the key (or with another), mount and
// verify exit 6 naming the snapshot and its recipient type, nothing is
// mounted and no key shows; a writer that forgot --encrypt-to is refused
// before it mounts; a read-only mount needs no recipients.
func TestE2EEncryptedRefusals(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	keys := e2eDir(t, "keys")
	key := filepath.Join(keys, "key.txt")
	pub, err := crypt.WriteNewKey(key, "test")
	if err != nil {
		t.Fatal(err)
	}
	r, _ := crypt.ParseRecipients([]string{pub})
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	home := makeTree(t, 1)
	want := snapshotTree(t, home)
	id := publishTree(t, uploader.NewCatalog(s, uploader.CatalogOptions{Recipients: r}), home).ID

	noKey := newHost(t, store)
	code, _, errs := noKey.run("verify", id)
	if code != exitCrypt || !strings.Contains(errs, id) || !strings.Contains(errs, "X25519") {
		t.Errorf("verify without a key: %d %s", code, errs)
	}
	mp2 := filepath.Join(e2eDir(t, "home2"), "hermes")
	os.MkdirAll(mp2, 0o755)
	other := filepath.Join(keys, "other.txt")
	if _, err := crypt.WriteNewKey(other, "test"); err != nil {
		t.Fatal(err)
	}
	secret := mustRead(t, other)
	noKey.extraEnv = []string{"HERMESFS_ENCRYPT_TO=" + pub, "HERMESFS_IDENTITY=" + other}
	d2 := noKey.start(mp2)
	if c := d2.wait(); c != exitCrypt || fs.IsMountpoint(mp2) || !strings.Contains(d2.stderr.String(), id) || !strings.Contains(d2.stderr.String(), "X25519") {
		t.Fatalf("mount with the wrong key: exit %d, mounted %v\n%s", c, fs.IsMountpoint(mp2), d2.stderr)
	}
	if strings.Contains(d2.stderr.String(), strings.TrimSpace(secret[strings.LastIndex(secret, "AGE-SECRET"):])) {
		t.Error("the log shows the key")
	}
	cached, _ := filepath.Glob(filepath.Join(noKey.state, "cache", "*"))
	if len(cached) != 0 {
		t.Errorf("a refused mount left %v in the state dir", cached)
	}

	// A writer that forgot --encrypt-to is refused before it mounts, its
	// state dir untouched.
	a := newHost(t, store)
	a.extraEnv = []string{"HERMESFS_IDENTITY=" + key}
	mp := filepath.Join(e2eDir(t, "home"), "hermes")
	os.MkdirAll(mp, 0o755)
	d3 := a.start(mp)
	if c := d3.wait(); c != exitCrypt || fs.IsMountpoint(mp) || !strings.Contains(d3.stderr.String(), "--allow-plaintext") {
		t.Fatalf("plaintext writer over an encrypted LATEST: exit %d\n%s", c, d3.stderr)
	}
	if ents, _ := os.ReadDir(filepath.Join(a.state, "cache")); len(ents) != 0 {
		t.Errorf("a refused mount wrote %d entries in the cache", len(ents))
	}
	// Read-only needs no recipients.
	d4 := a.mount(mp, "--read-only")
	if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
		t.Errorf("read-only mount differs:\n%s", diff)
	}
	if c := d4.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("read-only stop: %d\n%s", c, d4.stderr)
	}
	if got := localLatest(t, storeDir); got != id {
		t.Errorf("LATEST moved to %s", got)
	}
}

// TestE2EEncryptedCorruptFallback: a newest encrypted snapshot with a
// flipped byte is refused as corrupt at boot, and the mount falls back to
// the one before, as for a corrupt plaintext snapshot.
func TestE2EEncryptedCorruptFallback(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	key := filepath.Join(e2eDir(t, "keys"), "key.txt")
	pub, err := crypt.WriteNewKey(key, "test")
	if err != nil {
		t.Fatal(err)
	}
	r, _ := crypt.ParseRecipients([]string{pub})
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Recipients: r})
	home := makeTree(t, 1)
	want := snapshotTree(t, home)
	older := publishTree(t, cat, home).ID
	newest := publishTree(t, cat, makeTree(t, 2)).ID
	obj := filepath.Join(storeDir, "snapshots", newest+".sqfs")
	b, err := os.ReadFile(obj)
	if err != nil {
		t.Fatal(err)
	}
	b[len(b)/2] ^= 1
	if err := os.WriteFile(obj, b, 0o644); err != nil {
		t.Fatal(err)
	}
	h := newHost(t, "file://"+storeDir)
	h.extraEnv = []string{"HERMESFS_IDENTITY=" + key}
	mp := filepath.Join(e2eDir(t, "home"), "hermes")
	os.MkdirAll(mp, 0o755)
	d := h.mount(mp, "--read-only")
	if !strings.Contains(d.ready, "snapshot="+older) {
		t.Errorf("ready line %q, want the older snapshot %s", d.ready, older)
	}
	if diff := diffTrees(want, snapshotTree(t, mp)); diff != "" {
		t.Errorf("fallback mount differs:\n%s", diff)
	}
	if log := d.stderr.String(); !strings.Contains(log, newest) || !strings.Contains(log, "authentication") && !strings.Contains(log, "sha256 does not match") {
		t.Errorf("the log does not name the damaged snapshot and why:\n%s", d.stderr)
	}
	if c := d.stop(syscall.SIGTERM); c != 0 {
		t.Fatalf("stop: %d\n%s", c, d.stderr)
	}
}
