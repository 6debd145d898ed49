package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"filippo.io/age"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
)

// encryptWith is a daemon edit: new snapshots to recipient, read with the
// identity files given (none: no --identity).
func encryptWith(t *testing.T, recipient string, identityFiles ...string) func(*Config, *Options) {
	return func(c *Config, o *Options) {
		o.Encryption = func(co *uploader.CatalogOptions) error {
			r, err := crypt.ParseRecipients([]string{recipient})
			if err != nil {
				return err
			}
			co.Recipients = r
			if len(identityFiles) > 0 {
				ids, err := crypt.LoadIdentities(identityFiles)
				if err != nil {
					return err
				}
				co.Identities = ids
			}
			return nil
		}
	}
}

// keyFile writes a new age identity to a file and returns it and its path.
func keyFile(t *testing.T, dir, name string) (*age.X25519Identity, string) {
	t.Helper()
	id, err := age.GenerateX25519Identity()
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(id.String()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return id, p
}

// TestRunIdentityCheckedWhenCached: after a clean stop the encrypted base
// is complete in the state dir's cache, as plaintext, and reads without a
// key. A mount with a wrong --identity, or none, is still refused with
// exit 6 and nothing mounted, on that state dir as on a new host; the
// right one mounts it.
func TestRunIdentityCheckedWhenCached(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, state, runDir := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "state"), filepath.Join(root, "run")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	key, keyPath := keyFile(t, root, "key.txt")
	_, wrongPath := keyFile(t, root, "wrong.txt")
	rcpt := key.Recipient().String()

	a := startDaemonWith(t, store, mp, state, runDir, encryptWith(t, rcpt, keyPath))
	writeSynced(t, filepath.Join(mp, "secret.txt"), "only for the key\n")
	if err := a.stop(t); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if st, _ := ReadState(state); !st.CleanShutdown || st.Base == "" {
		t.Fatalf("state after a clean stop: %+v", st)
	}

	for _, c := range []struct {
		name string
		ids  []string
	}{{"a wrong --identity", []string{wrongPath}}, {"no --identity", nil}} {
		logs, err := runRefused(t, store, mp, state, encryptWith(t, rcpt, c.ids...))
		if ExitCode(err) != ExitCrypt {
			t.Errorf("%s on the state dir holding the snapshot: %v (exit %d), want exit %d; logs:\n%s", c.name, err, ExitCode(err), ExitCrypt, logs)
		}
		if fs.IsMountpoint(mp) {
			t.Fatalf("%s: something is mounted", c.name)
		}
		if err != nil && !strings.Contains(err.Error(), "identit") {
			t.Errorf("%s: the refusal %q does not name the identity", c.name, err)
		}
	}
	r := startDaemonWith(t, store, mp, state, runDir, encryptWith(t, rcpt, keyPath))
	if got, _ := os.ReadFile(filepath.Join(mp, "secret.txt")); string(got) != "only for the key\n" {
		t.Errorf("with the right key: %q", got)
	}
	if err := r.stop(t); err != nil {
		t.Fatal(err)
	}
}
