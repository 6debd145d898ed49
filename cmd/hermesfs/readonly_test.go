package main

import (
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
)

// Commands that read never create the default store, a state dir or a
// runtime dir; a missing store and a mistyped store URL are reported by
// what is wrong.
func TestReadOnlyCommandsCreateNothing(t *testing.T) {
	t.Parallel()
	root := t.TempDir()
	environ := map[string]string{
		"HOME":            filepath.Join(root, "home"),
		"XDG_DATA_HOME":   filepath.Join(root, "data"),
		"XDG_STATE_HOME":  filepath.Join(root, "state"),
		"XDG_RUNTIME_DIR": filepath.Join(root, "run"),
	}
	mp := filepath.Join(root, "mnt", "hermes")
	defaultState, err := daemon.DefaultStateDir(mp, os.Getuid(), func(k string) string { return environ[k] })
	if err != nil {
		t.Fatal(err)
	}
	id := "20261122T134501.123Z-box-1a2b3c4d"
	for _, c := range []struct {
		args []string
		code int
		want string // in stdout+stderr
	}{
		{[]string{"list"}, exitFailure, "no store at " + filepath.Join(root, "data", "hermesfs", "store")},
		{[]string{"list", "--json"}, exitFailure, "the directory does not exist"},
		{[]string{"status"}, exitOK, "no hermesfs mounts are running"},
		{[]string{"status", "--json"}, exitOK, "[]"},
		{[]string{"status", mp}, exitFailure, "not running"},
		{[]string{"verify", id}, exitFailure, "no store at"},
		{[]string{"restore", "--snapshot", id, filepath.Join(root, "dest")}, exitFailure, "no store at"},
		{[]string{"prune", "--dry-run"}, exitFailure, "no store at"},
		{[]string{"list", "--store", "file://" + filepath.Join(root, "typo")}, exitFailure, "no store at " + filepath.Join(root, "typo")},
		{[]string{"list", "--store", "s3:/bucket/alice"}, exitUsage, "two slashes"},
		{[]string{"list", "--store", "s3:bucket"}, exitUsage, "two slashes"},
		{[]string{"list", "--store", "file:relative/store"}, exitUsage, "file:///absolute/path"},
		{[]string{"list", "--store", "s3://"}, exitUsage, "no bucket"},
		{[]string{"list", "--store", "s3://127.0.0.1:9000/bucket"}, exitUsage, "?endpoint=http://127.0.0.1:9000"},
		{[]string{"list", "--store", "gs://bucket/alice"}, exitUsage, `unknown scheme "gs"`},
		{[]string{"list", "--store", "https://minio.local/bucket"}, exitUsage, "s3://bucket/prefix?endpoint=https://minio.local"},
		{[]string{"list", "--store", "s3://bkt?endpont=http://x"}, exitUsage, `unknown setting "endpont"`},
		{[]string{"restore", "--store", "s3:/bkt", filepath.Join(root, "dest")}, exitUsage, "two slashes"},
	} {
		code, out, errOut := runCLIEnv(t, environ, c.args...)
		if code != c.code || !strings.Contains(out+errOut, c.want) {
			t.Errorf("%q: exit %d, want %d with %q; stdout %q stderr %q", c.args, code, c.code, c.want, out, errOut)
		}
	}
	// Nothing was created: the temp root is as empty as it began.
	filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if p != root {
			t.Errorf("created %s", p)
		}
		return nil
	})
	if _, err := os.Stat(defaultState); err == nil {
		t.Errorf("status created the state dir %s", defaultState)
	}
}
