package main

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// runCLIEnv runs the CLI in-process with the given environment.
func runCLIEnv(t *testing.T, environ map[string]string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	e := &env{stdout: &out, stderr: &errb, getenv: func(k string) string { return environ[k] }}
	code = e.main(t.Context(), args)
	return code, out.String(), errb.String()
}

// makeTree writes a small home with a marker that tells versions apart.
func makeTree(t *testing.T, version int) string {
	t.Helper()
	dir := t.TempDir()
	files := map[string]string{
		"memories/MEMORY.md": fmt.Sprintf("version %d\n§\nlikes Go", version),
		"sessions/s1.json":   strings.Repeat(`{"turn":1}`, 1000),
		"config.yaml":        "memory:\n  memory_char_limit: 2200\n",
	}
	for name, content := range files {
		p := filepath.Join(dir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// publishTree packs dir and publishes it on top of LATEST.
func publishTree(t *testing.T, cat *uploader.Catalog, dir string) uploader.Manifest {
	t.Helper()
	return publishTreeChunks(t, cat, dir, 0)
}

// publishTreeChunks is publishTree with the manifest's chunk digests over
// chunkSize slices (0: the default).
func publishTreeChunks(t *testing.T, cat *uploader.Catalog, dir string, chunkSize int64) uploader.Manifest {
	t.Helper()
	p := filepath.Join(t.TempDir(), "a.sqfs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	res, err := archive.PackDir(t.Context(), f, dir, archive.PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	latest, err := cat.LatestID(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	m, err := cat.Publish(t.Context(), uploader.PublishInput{
		Path: p, SHA256: hex.EncodeToString(res.SHA256[:]), Size: res.Size,
		Parent: latest, Expect: latest, Files: res.Files, ChunkSize: chunkSize,
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func readMarker(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "memories", "MEMORY.md"))
	if err != nil {
		t.Fatalf("restored tree: %v", err)
	}
	return strings.SplitN(string(b), "\n", 2)[0]
}

func flipBit(t *testing.T, s uploader.Store, key string) {
	t.Helper()
	rc, info, err := s.Get(t.Context(), key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	buf.ReadFrom(rc)
	rc.Close()
	b := buf.Bytes()
	b[len(b)/2] ^= 0x04
	if _, err := s.Put(t.Context(), key, bytes.NewReader(b), info.Size, uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestStoreCommandsLocal(t *testing.T) {
	storeDir := t.TempDir()
	url := "file://" + storeDir
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "box"})
	environ := map[string]string{"HERMESFS_STORE": url}

	if code, out, _ := runCLIEnv(t, environ, "list"); code != exitOK || !strings.Contains(out, "no snapshots") {
		t.Errorf("list of an empty store: %d %q", code, out)
	}
	if code, _, errOut := runCLIEnv(t, environ, "restore", t.TempDir()+"/x"); code != exitFailure || !strings.Contains(errOut, "no snapshot") {
		t.Errorf("restore from an empty store: %d %q", code, errOut)
	}
	var ms []uploader.Manifest
	for v := range 3 {
		ms = append(ms, publishTree(t, cat, makeTree(t, v)))
	}

	code, out, errOut := runCLIEnv(t, environ, "list")
	if code != exitOK {
		t.Fatalf("list: %d %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 4 || !strings.HasPrefix(lines[1], "* "+ms[2].ID) || !strings.HasPrefix(lines[3], "  "+ms[0].ID) || !strings.Contains(lines[1], " box") {
		t.Errorf("list output:\n%s", out)
	}
	code, out, _ = runCLIEnv(t, nil, "list", "--json", "--store", url)
	var entries []listEntry
	if err := json.Unmarshal([]byte(out), &entries); code != exitOK || err != nil || len(entries) != 3 {
		t.Fatalf("list --json: %d %v\n%s", code, err, out)
	}
	if !entries[0].Latest || entries[0].ID != ms[2].ID || entries[1].Latest || entries[0].Files != ms[2].Files || entries[0].Files < 3 {
		t.Errorf("list --json entries: %+v", entries)
	}

	dst := filepath.Join(t.TempDir(), "restored")
	if code, out, errOut := runCLIEnv(t, environ, "restore", dst); code != exitOK || !strings.Contains(out, ms[2].ID) {
		t.Fatalf("restore: %d %q %q", code, out, errOut)
	}
	if m := readMarker(t, dst); m != "version 2" {
		t.Errorf("restored %q, want version 2", m)
	}
	if code, _, errOut := runCLIEnv(t, environ, "restore", dst); code != exitUsage || !strings.Contains(errOut, "not empty") {
		t.Errorf("restore into a non-empty dir: %d %q", code, errOut)
	}
	old := filepath.Join(t.TempDir(), "old")
	if code, _, errOut := runCLIEnv(t, environ, "restore", "--snapshot", ms[0].ID, old); code != exitOK || readMarker(t, old) != "version 0" {
		t.Errorf("restore --snapshot: %d %q", code, errOut)
	}
	if code, _, _ := runCLIEnv(t, environ, "restore", "--snapshot", "LATEST", t.TempDir()); code != exitUsage {
		t.Errorf("restore --snapshot LATEST: exit %d, want usage", code)
	}

	// The bucket is readable without hermesfs.
	if _, err := exec.LookPath("unsquashfs"); err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") == "1" {
			t.Fatal("unsquashfs not installed")
		}
	} else {
		latest, _ := os.ReadFile(filepath.Join(storeDir, "LATEST"))
		plain := filepath.Join(t.TempDir(), "plain")
		out, err := exec.Command("unsquashfs", "-d", plain, filepath.Join(storeDir, "snapshots", strings.TrimSpace(string(latest))+".sqfs")).CombinedOutput()
		if err != nil || readMarker(t, plain) != "version 2" {
			t.Errorf("unsquashfs of the LATEST archive: %v\n%s", err, out)
		}
	}

	// verify by id: good and corrupt.
	fset := flag.NewFlagSet("verify", flag.ContinueOnError)
	addStoreFlags(fset)
	var vout bytes.Buffer
	ve := &env{stdout: &vout, stderr: &vout, getenv: func(k string) string { return environ[k] }}
	if err := verifySnapshot(t.Context(), ve, fset, ms[2].ID); err != nil || !strings.Contains(vout.String(), "ok") {
		t.Errorf("verify good snapshot: %v %q", err, vout.String())
	}
	flipBit(t, s, uploader.ArchiveKey(ms[2].ID))
	err = verifySnapshot(t.Context(), ve, fset, ms[2].ID)
	var xe *exitError
	if !errors.As(err, &xe) || xe.Code != exitCorrupt || !strings.Contains(err.Error(), ms[2].ID) {
		t.Errorf("verify corrupt snapshot: %v", err)
	}
	if err := verifySnapshot(t.Context(), ve, fset, "no-such-file.sqfs"); err == nil {
		t.Error("verify of a non-id accepted")
	}

	// The corrupt newest snapshot is skipped, loudly.
	dst2 := filepath.Join(t.TempDir(), "fallback")
	code, _, errOut = runCLIEnv(t, environ, "restore", dst2)
	if code != exitOK || readMarker(t, dst2) != "version 1" || !strings.Contains(errOut, "WARNING") || !strings.Contains(errOut, ms[2].ID) {
		t.Errorf("restore past a corrupt snapshot: %d, stderr %q", code, errOut)
	}

	// prune
	if code, _, _ := runCLIEnv(t, environ, "prune", "--keep", "0"); code != exitUsage {
		t.Errorf("prune --keep 0: exit %d", code)
	}
	code, out, errOut = runCLIEnv(t, environ, "prune", "--keep", "2")
	if code != exitOK || !strings.Contains(out, "deleted "+ms[0].ID) || strings.Contains(out, ms[1].ID) {
		t.Errorf("prune --keep 2: %d %q %q", code, out, errOut)
	}
	_, out, _ = runCLIEnv(t, environ, "list", "--json")
	json.Unmarshal([]byte(out), &entries)
	if len(entries) != 2 {
		t.Errorf("after prune: %d snapshots", len(entries))
	}

	// Every snapshot corrupt: exit 3.
	flipBit(t, s, uploader.ArchiveKey(ms[1].ID))
	if code, _, errOut := runCLIEnv(t, environ, "restore", filepath.Join(t.TempDir(), "none")); code != exitCorrupt {
		t.Errorf("restore with every snapshot corrupt: exit %d %q", code, errOut)
	}
}

func TestStoreCommandsS3(t *testing.T) {
	endpoint, bucket, access, secret := s3test.Start(t)
	environ := map[string]string{
		"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1",
		"HERMESFS_S3_ENDPOINT": endpoint,
	}
	url := "s3://" + bucket + "/agents/alice"
	s, _, err := storeurl.Open(t.Context(), url, storeurl.Options{Getenv: func(k string) string { return environ[k] }, Endpoint: endpoint})
	if err != nil {
		t.Fatal(err)
	}
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm"})
	m0 := publishTree(t, cat, makeTree(t, 0))
	m1 := publishTree(t, cat, makeTree(t, 1))

	code, out, errOut := runCLIEnv(t, environ, "list", "--store", url)
	if code != exitOK || !strings.Contains(out, "* "+m1.ID) || !strings.Contains(out, m0.ID) {
		t.Fatalf("list on S3: %d %q %q", code, out, errOut)
	}
	dst := filepath.Join(t.TempDir(), "r")
	if code, _, errOut := runCLIEnv(t, environ, "restore", "--store", url, dst); code != exitOK || readMarker(t, dst) != "version 1" {
		t.Fatalf("restore from S3: %d %q", code, errOut)
	}
	// Wrong credentials: a clear failure that does not show the secret.
	bad := map[string]string{"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": "not-the-secret", "HERMESFS_S3_ENDPOINT": endpoint}
	code, _, errOut = runCLIEnv(t, bad, "list", "--store", url)
	if code == exitOK || strings.Contains(errOut, "not-the-secret") || !strings.Contains(errOut, "403") {
		t.Errorf("bad credentials: %d %q", code, errOut)
	}
	if code, _, errOut := runCLIEnv(t, environ, "list", "--store", "s3://AKIA:hunter2@"+bucket); code != exitUsage || strings.Contains(errOut, "hunter2") {
		t.Errorf("credentials in the URL: %d %q", code, errOut)
	}
}

func TestStoreCommandsHelp(t *testing.T) {
	for _, name := range []string{"list", "restore", "prune"} {
		code, out, _ := runCLI(t, name, "--help")
		for _, want := range []string{"-store ", "-s3-endpoint ", "-s3-region ", "-s3-path-style", "r2.cloudflarestorage.com", "127.0.0.1:9000", "s3://my-bucket", "file:///", "AWS_ACCESS_KEY_ID"} {
			if code != exitOK || !strings.Contains(out, want) {
				t.Errorf("%s --help lacks %q", name, want)
			}
		}
	}
}
