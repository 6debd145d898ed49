package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestBadStoreURLOrRecipientIsUsage: a store URL that cannot be right, or a
// recipient that is not a key, is a bad command line (exit 2) for every
// command that takes one, mount included, and mount refuses it before it
// creates its state dir. The recipient error says what a recipient looks
// like; the library's words come last, as the cause.
func TestBadStoreURLOrRecipientIsUsage(t *testing.T) {
	dir := t.TempDir()
	mp, state := filepath.Join(dir, "home"), filepath.Join(dir, "no", "state")
	if err := os.Mkdir(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	store := filepath.Join(dir, "store")
	for _, c := range []struct {
		args []string
		says []string
	}{
		{[]string{"mount", "--store", "s3:bucket", "--state-dir", state, mp}, []string{"two slashes"}},
		{[]string{"mount", "--store", "https://minio.local/bucket", "--state-dir", state, mp}, []string{"s3://bucket/prefix?endpoint=https://"}},
		{[]string{"list", "--store", "s3:bucket"}, []string{"two slashes"}},
		{[]string{"restore", "--store", "s3:bucket", filepath.Join(dir, "r")}, []string{"two slashes"}},
		{[]string{"restore", "--store", "s3:bucket", "--path", "memories", filepath.Join(dir, "r")}, []string{"two slashes"}},
		{[]string{"prune", "--store", "s3:bucket", "--dry-run"}, []string{"two slashes"}},
		{[]string{"verify", "--store", "s3:bucket", "20261122T134501.123Z-vm1-1a2b3c4d"}, []string{"two slashes"}},
		{[]string{"browse", "--store", "s3:bucket", mp}, []string{"two slashes"}},
		{[]string{"mount", "--store", store, "--encrypt-to", "age1notakey", "--state-dir", state, mp},
			[]string{"--encrypt-to: recipient age1notakey: not a valid age public key", "hermesfs keygen", `(cause: malformed recipient "age1notakey"`}},
		{[]string{"mount", "--store", store, "--encrypt-to", "ssh-ed25519 AAAAnot", "--state-dir", state, mp},
			[]string{"not a valid SSH public key", "(cause: "}},
		{[]string{"pack", "--encrypt-to", "nonsense", mp, filepath.Join(dir, "a.sqfs")},
			[]string{"not a recipient: give an age public key (age1…"}},
	} {
		code, _, stderr := runCLI(t, c.args...)
		if code != exitUsage {
			t.Errorf("%q: exit %d, want %d (bad command line); stderr:\n%s", c.args, code, exitUsage, stderr)
		}
		for _, s := range c.says {
			if !strings.Contains(stderr, s) {
				t.Errorf("%q: stderr lacks %q:\n%s", c.args, s, stderr)
			}
		}
		if _, err := os.Stat(filepath.Join(dir, "no")); !os.IsNotExist(err) {
			t.Fatalf("%q: the refused mount created its state dir (%v)", c.args, err)
		}
	}
	if _, err := os.Stat(store); !os.IsNotExist(err) {
		t.Errorf("a refused mount created the local store (%v)", err)
	}
}
