package main

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
)

func TestCryptFlagsAndEnv(t *testing.T) {
	dir := t.TempDir()
	k1, k2 := filepath.Join(dir, "k1"), filepath.Join(dir, "k2")
	p1, _ := crypt.WriteNewKey(k1, "t")
	p2, _ := crypt.WriteNewKey(k2, "t")
	parse := func(environ map[string]string, args ...string) (uploader.CatalogOptions, error) {
		fs := flag.NewFlagSet("x", flag.ContinueOnError)
		addIdentityFlag(fs)
		addEncryptFlags(fs)
		if err := fs.Parse(args); err != nil {
			t.Fatal(err)
		}
		var o uploader.CatalogOptions
		e := &env{getenv: func(k string) string { return environ[k] }}
		return o, cryptOptions(e, fs, &o)
	}
	o, err := parse(nil, "--encrypt-to", p1, "--encrypt-to", p2, "--identity", k1, "--identity", k2, "--allow-plaintext")
	if err != nil || o.Recipients.Len() != 2 || len(o.Identities.Files()) != 2 || !o.AllowPlaintext {
		t.Fatalf("flags: %+v %v", o, err)
	}
	o, err = parse(map[string]string{"HERMESFS_ENCRYPT_TO": p1 + "," + p2, "HERMESFS_IDENTITY": k1 + ":" + k2, "HERMESFS_ALLOW_PLAINTEXT": "1"})
	if err != nil || o.Recipients.Len() != 2 || len(o.Identities.Files()) != 2 || !o.AllowPlaintext {
		t.Fatalf("env: %+v %v", o, err)
	}
	// The flag wins over the environment.
	o, err = parse(map[string]string{"HERMESFS_ENCRYPT_TO": "bogus"}, "--encrypt-to", p1)
	if err != nil || o.Recipients.Len() != 1 {
		t.Fatalf("flag over env: %v", err)
	}
	os.Chmod(k1, 0o640)
	if _, err := parse(nil, "--identity", k1); err == nil || !strings.Contains(err.Error(), "too open") {
		t.Fatalf("group-readable key: %v", err)
	}
	secret := mustRead(t, k2)
	sk := secret[strings.Index(secret, "AGE-SECRET"):]
	_, err = parse(nil, "--encrypt-to", strings.TrimSpace(sk))
	if err == nil || strings.Contains(err.Error(), sk[16:40]) {
		t.Fatalf("private key as recipient: %v", err)
	}
}

func TestCryptCommands(t *testing.T) {
	dir := t.TempDir()
	key := filepath.Join(dir, "key.txt")
	environ := map[string]string{"HERMESFS_STORE": "file://" + filepath.Join(dir, "store")}
	code, pub, _ := runCLIEnv(t, environ, "keygen", key)
	pub = strings.TrimSpace(pub)
	if code != 0 || !strings.HasPrefix(pub, "age1") {
		t.Fatalf("keygen: %d %q", code, pub)
	}
	if code, _, errs := runCLIEnv(t, environ, "keygen", key); code != exitFailure || !strings.Contains(errs, "exists") {
		t.Fatalf("keygen over an existing file: %d %s", code, errs)
	}
	s, err := uploader.NewLocal(filepath.Join(dir, "store"))
	if err != nil {
		t.Fatal(err)
	}
	r, _ := crypt.ParseRecipients([]string{pub})
	plainID := publishTree(t, uploader.NewCatalog(s, uploader.CatalogOptions{}), makeTree(t, 1)).ID
	encID := publishTree(t, uploader.NewCatalog(s, uploader.CatalogOptions{Recipients: r}), makeTree(t, 2)).ID

	code, out, _ := runCLIEnv(t, environ, "list", "--json")
	var entries []listEntry
	if code != 0 || json.Unmarshal([]byte(out), &entries) != nil || len(entries) != 2 {
		t.Fatalf("list: %d %s", code, out)
	}
	if entries[0].ID != encID || entries[0].Encryption == nil || entries[0].Files != 0 || entries[1].ID != plainID || entries[1].Encryption != nil {
		t.Fatalf("list entries %+v", entries)
	}
	if code, _, errs := runCLIEnv(t, environ, "verify", encID); code != exitCrypt || !strings.Contains(errs, "X25519") {
		t.Fatalf("verify without a key: %d %s", code, errs)
	}
	one := filepath.Join(dir, "MEMORY.md")
	if code, _, errs := runCLIEnv(t, environ, "restore", "--path", "memories/MEMORY.md", one); code != exitCrypt || !strings.Contains(errs, "X25519") {
		t.Fatalf("restore --path without a key: %d %s", code, errs)
	}
	environ["HERMESFS_IDENTITY"] = key
	if code, _, errs := runCLIEnv(t, environ, "restore", "--path", "memories/MEMORY.md", one); code != 0 {
		t.Fatalf("restore --path of an encrypted snapshot: %d %s", code, errs)
	}
	if b := mustRead(t, one); !strings.HasPrefix(b, "version 2\n") {
		t.Fatalf("restore --path of an encrypted snapshot gave %q", b)
	}
	if code, out, errs := runCLIEnv(t, environ, "verify", encID); code != 0 {
		t.Fatalf("verify: %d %s %s", code, out, errs)
	}
	rdir := filepath.Join(dir, "restored")
	if code, out, errs := runCLIEnv(t, environ, "restore", rdir); code != 0 || !strings.Contains(out, "encrypted (X25519)") {
		t.Fatalf("restore: %d %s %s", code, out, errs)
	}
	if got := readMarker(t, rdir); !strings.Contains(got, "version 2") {
		t.Fatalf("restored %q", got)
	}

	// A local copy of the object, damaged: verify FILE says corrupt.
	obj := mustRead(t, filepath.Join(dir, "store", "snapshots", encID+".sqfs"))
	bad := []byte(obj)
	bad[len(bad)-100] ^= 1
	badPath := filepath.Join(dir, "bad.sqfs.age")
	os.WriteFile(badPath, bad, 0o600)
	if code, _, errs := runCLIEnv(t, environ, "verify", badPath); code != exitCorrupt {
		t.Fatalf("verify of a damaged age file: %d %s", code, errs)
	}
	good := filepath.Join(dir, "good.sqfs.age")
	os.WriteFile(good, []byte(obj), 0o600)
	if code, _, errs := runCLIEnv(t, environ, "verify", good); code != 0 {
		t.Fatalf("verify of the age file: %d %s", code, errs)
	}
	// pack --encrypt-to writes an age file; pack --base reads one with
	// --identity and still reuses its blocks.
	tree := makeTree(t, 3)
	sealed := filepath.Join(dir, "p.sqfs.age")
	if code, out, errs := runCLIEnv(t, environ, "pack", "--encrypt-to", pub, tree, sealed); code != 0 || !strings.Contains(out, "encrypted with age") {
		t.Fatalf("pack --encrypt-to: %d %s %s", code, out, errs)
	}
	if b := mustRead(t, sealed); !crypt.IsEncrypted([]byte(b)) || strings.Contains(b, "version 3") {
		t.Fatal("pack --encrypt-to wrote no age file")
	}
	if code, out, errs := runCLIEnv(t, environ, "pack", "--base", sealed, tree, filepath.Join(dir, "p2.sqfs")); code != 0 || !strings.Contains(out, "reused") {
		t.Fatalf("pack --base on an age file: %d %s %s", code, out, errs)
	}
	udir := filepath.Join(dir, "unpacked")
	if code, _, errs := runCLIEnv(t, environ, "unpack", sealed, udir); code != 0 || readMarker(t, udir) != "version 3" {
		t.Fatalf("unpack of the packed age file: %d %s", code, errs)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, ".*")); len(left) != 0 {
		t.Errorf("temporary files left: %v", left)
	}
	delete(environ, "HERMESFS_IDENTITY")
	if code, _, errs := runCLIEnv(t, environ, "unpack", good, filepath.Join(dir, "u")); code != exitCrypt {
		t.Fatalf("unpack without a key: %d %s", code, errs)
	}
}
