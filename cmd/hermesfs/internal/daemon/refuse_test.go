package daemon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"filippo.io/age"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// TestRunRefusedLeavesStateDir: a mount that is refused (the lease is held,
// local changes conflict with another host's snapshot, LATEST is encrypted
// and no recipient is given, a store URL or recipient that cannot be right,
// a state dir of another mountpoint) changes nothing in the state dir: what
// it created (the dir and its parents, lock, cache/, pack/, upper/) is taken
// away again, and what was there before stays as it was.
func TestRunRefusedLeavesStateDir(t *testing.T) {
	needFUSE(t) // checked before any of these refusals
	root := tempDir(t)
	mp := filepath.Join(root, "home")
	if err := os.Mkdir(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	// newStore makes a local store; with held, another writer holds its
	// lease; with latest, it holds a snapshot of another host's (encrypted
	// with enc).
	newStore := func(t *testing.T, held, latest bool, enc *crypt.Recipients) string {
		t.Helper()
		dir, err := os.MkdirTemp(root, "store-")
		if err != nil {
			t.Fatal(err)
		}
		s, err := uploader.NewLocal(dir)
		if err != nil {
			t.Fatal(err)
		}
		other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "other-1a2b3c4d", Recipients: enc})
		if latest {
			p := filepath.Join(dir, "..", filepath.Base(dir)+".sqfs")
			os.WriteFile(p, []byte("another host's snapshot"), 0o600) // the catalog never parses it
			if _, err := other.Publish(t.Context(), uploader.PublishInput{Path: p}); err != nil {
				t.Fatal(err)
			}
		}
		if held {
			l, err := other.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "hermesfs mount /elsewhere", Heartbeat: -1})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { l.Release(t.Context()) })
		}
		return dir
	}
	id, err := age.GenerateX25519Identity()
	if err != nil {
		t.Fatal(err)
	}
	recipients, err := crypt.ParseRecipients([]string{id.Recipient().String()})
	if err != nil {
		t.Fatal(err)
	}
	// localChanges leaves in the state dir what a crash leaves: changes
	// in the upper layer that no snapshot has.
	localChanges := func(t *testing.T, state string) {
		os.MkdirAll(filepath.Join(state, "upper"), 0o700)
		os.WriteFile(filepath.Join(state, "upper", "notes.md"), []byte("unpublished\n"), 0o600)
		os.WriteFile(filepath.Join(state, "state.json"), []byte(`{"mountpoint": "`+mp+`", "host": "here-5e6f7a8b", "unpublished": true}`), 0o600)
	}
	for _, c := range []struct {
		name   string
		store  func(t *testing.T) string
		before func(t *testing.T, state string)
		mod    func(*Config, *Options)
		code   int
		says   string
	}{
		{"lease held", func(t *testing.T) string { return newStore(t, true, false, nil) }, nil, nil, ExitConflict, "in use by"},
		{"encrypted LATEST, no recipient", func(t *testing.T) string { return newStore(t, false, true, recipients) }, nil, nil, ExitCrypt, "encrypted"},
		{"local changes, another host published", func(t *testing.T) string { return newStore(t, false, true, nil) }, localChanges, nil, ExitConflict, "--on-conflict"},
		{"state dir of another mountpoint", func(t *testing.T) string { return newStore(t, false, false, nil) },
			func(t *testing.T, state string) {
				os.MkdirAll(state, 0o700)
				os.WriteFile(filepath.Join(state, "state.json"), []byte(`{"mountpoint": "/another/home"}`), 0o600)
			}, nil, ExitUsage, "belongs to mountpoint /another/home"},
		{"store URL that cannot be right", func(t *testing.T) string { return newStore(t, false, false, nil) }, nil,
			func(_ *Config, o *Options) {
				store := o.Store
				o.Store = func(l *slog.Logger) (string, storeurl.Options, error) {
					_, so, err := store(l)
					return "s3:bucket", so, err
				}
			}, ExitUsage, "two slashes"},
		{"recipient that is not a key", func(t *testing.T) string { return newStore(t, false, false, nil) }, nil,
			func(_ *Config, o *Options) {
				o.Encryption = func(*uploader.CatalogOptions) error {
					_, err := crypt.ParseRecipients([]string{"age1notakey"})
					return UsageError("--encrypt-to: %v", err)
				}
			}, ExitUsage, "age1notakey"},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			top, err := os.MkdirTemp(root, "state-")
			if err != nil {
				t.Fatal(err)
			}
			// A fresh state dir two levels below a directory that does
			// not exist yet either; or, with before, one that does.
			state := filepath.Join(top, "a", "b", "state")
			if c.before != nil {
				c.before(t, state)
			} else if err := os.Remove(top); err != nil {
				t.Fatal(err)
			}
			was := tree(t, top)
			logs, err := runRefused(t, c.store(t), mp, state, c.mod)
			if ExitCode(err) != c.code || !strings.Contains(fmt.Sprint(err), c.says) {
				t.Fatalf("Run: %v (exit %d), want exit %d saying %q; logs:\n%s", err, ExitCode(err), c.code, c.says, logs)
			}
			if now := tree(t, top); !slices.Equal(now, was) {
				t.Errorf("the refused mount changed the state dir's tree\nbefore %q\nafter  %q", was, now)
			}
		})
	}
}

// tree lists everything below dir (nil when dir does not exist).
func tree(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		out = append(out, strings.TrimPrefix(p, dir))
		return nil
	})
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestRunStorePathTypo: a local store named by a path whose parent does
// not exist (a typo) is refused with a usage error, creating nothing; one
// whose parent exists is created, and the log says loudly that it is a
// new, empty store.
func TestRunStorePathTypo(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	mp := filepath.Join(root, "home")
	if err := os.Mkdir(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	typo := filepath.Join(root, "srv-typo", "hermes", "store")
	logs, err := runRefused(t, typo, mp, filepath.Join(root, "state"), nil)
	if ExitCode(err) != ExitUsage || !strings.Contains(fmt.Sprint(err), "does not exist, nor its parent") {
		t.Errorf("a store path with missing parents: %v (exit %d), want a usage error; logs:\n%s", err, ExitCode(err), logs)
	}
	for _, p := range []string{filepath.Join(root, "srv-typo"), filepath.Join(root, "state")} {
		if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the refused mount created %s: %v", p, err)
		}
	}

	fresh := filepath.Join(root, "new-store")
	r := startDaemon(t, fresh, mp, filepath.Join(root, "state"), filepath.Join(root, "run"))
	if logs := r.logs.String(); !strings.Contains(logs, "NEW EMPTY STORE") || !strings.Contains(logs, fresh) {
		t.Errorf("a new store made without a word:\n%s", logs)
	}
	if err := r.stop(t); err != nil {
		t.Fatal(err)
	}
	r = startDaemon(t, fresh, mp, filepath.Join(root, "state"), filepath.Join(root, "run"))
	if strings.Contains(r.logs.String(), "NEW EMPTY STORE") {
		t.Error("an existing store called new")
	}
	if err := r.stop(t); err != nil {
		t.Fatal(err)
	}
}
