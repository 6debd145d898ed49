package uploader_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/storetest"
)

func newLocal(t *testing.T) uploader.Store {
	s, err := uploader.NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestLocalConformance(t *testing.T) {
	storetest.Run(t, newLocal, storetest.Options{})
}

func TestLocalRetryConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) uploader.Store {
		return uploader.WithRetry(newLocal(t), uploader.RetryPolicy{}, nil)
	}, storetest.Options{})
}

// The directory stays plain files: no temporary files left behind, and the
// content readable without hermesfs.
func TestLocalLayout(t *testing.T) {
	dir := t.TempDir()
	s, err := uploader.NewLocal(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(t.Context(), "snapshots/a.json", strings.NewReader("{}"), 2, uploader.PutOptions{IfNoneMatch: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(t.Context(), "snapshots/a.json", &bytes.Buffer{}, 5, uploader.PutOptions{}); err == nil {
		t.Fatal("short put succeeded")
	}
	b, err := os.ReadFile(filepath.Join(dir, "snapshots", "a.json"))
	if err != nil || string(b) != "{}" {
		t.Fatalf("file: %q, %v", b, err)
	}
	ents, err := os.ReadDir(filepath.Join(dir, "snapshots"))
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() != "a.json" {
			t.Errorf("stray file %s in the store", e.Name())
		}
	}
}

// A file copied into the store by hand (no ETag attribute) still gets a
// stable ETag that conditional puts can match.
func TestLocalForeignFileETag(t *testing.T) {
	dir := t.TempDir()
	s, err := uploader.NewLocal(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "LATEST"), []byte("x\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := s.Stat(t.Context(), "LATEST")
	if err != nil {
		t.Fatal(err)
	}
	b, err := s.Stat(t.Context(), "LATEST")
	if err != nil || a.ETag != b.ETag || a.ETag == "" {
		t.Fatalf("ETags %q, %q, %v", a.ETag, b.ETag, err)
	}
	if _, err := s.Put(t.Context(), "LATEST", strings.NewReader("y\n"), 2, uploader.PutOptions{IfMatch: a.ETag}); err != nil {
		t.Fatalf("IfMatch on a foreign file: %v", err)
	}
}

func TestDefaultLocalDir(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	for _, c := range []struct {
		env  map[string]string
		uid  int
		want string
	}{
		{map[string]string{"XDG_DATA_HOME": "/x", "HOME": "/h"}, 1000, "/x/hermesfs/store"},
		{map[string]string{"HOME": "/h"}, 1000, "/h/.local/share/hermesfs/store"},
		{map[string]string{"HOME": "/root"}, 0, "/var/lib/hermesfs/store"},
		{map[string]string{"XDG_DATA_HOME": "relative", "HOME": "/h"}, 1000, "/h/.local/share/hermesfs/store"},
	} {
		got, err := uploader.DefaultLocalDir(env(c.env), c.uid)
		if err != nil || got != c.want {
			t.Errorf("%v uid %d: %q, %v; want %q", c.env, c.uid, got, err, c.want)
		}
	}
	if _, err := uploader.DefaultLocalDir(env(nil), 1000); err == nil {
		t.Error("no HOME: want an error")
	}
}
